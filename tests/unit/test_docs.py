"""The docs as users meet them: the MkDocs site builds with ``--strict`` (no broken link or
page), the configuration reference is the schema's current output, the README stays a front
page (at most 250 lines), and every ``rayrlhf`` command in the README and the getting-started
page is valid: train commands give their config with ``--dry-run``, the others parse with the
CLI's own parser."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import build_parser, main
from cluster.config.help import config_markdown

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]


def _commands(path: Path) -> list[str]:
    """The ``rayrlhf`` commands of a page's shell blocks (also after ``ray job submit ... --``)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if " -- rayrlhf " in line:
                line = line.split(" -- ", 1)[1]
            if line.startswith("rayrlhf "):
                out.append(line)
    return out


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def test_the_configuration_reference_is_the_schemas_current_output():
    assert (ROOT / "docs" / "reference" / "config.md").read_text() == config_markdown() + "\n", (
        "docs/reference/config.md is stale: rayrlhf config --markdown > docs/reference/config.md"
    )


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("command", sorted({c for p in PAGES for c in _commands(p)}))
def test_every_command_in_the_readme_and_getting_started_is_valid(command, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = shlex.split(command)[1:]
    if argv[0] == "train":
        assert main(argv + ["--dry-run"]) == 0, capsys.readouterr().err
        assert "run:" in capsys.readouterr().out
    else:
        build_parser().parse_args([re.sub(r"<[^>]+>", "placeholder", a) for a in argv])  # runs/<run>: any run


def _report():
    """``benchmarks/report.py``, imported by path (``benchmarks/`` is scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmarks_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_page_is_the_reports_current_output():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert _report().render(ROOT / "docs" / "results") == page, (
        "docs/benchmarks.md is stale: .venv/bin/python benchmarks/report.py"
    )


def test_every_result_file_has_a_section_on_the_benchmarks_page():
    headings = set(re.findall(r"^### (\S+)$", (ROOT / "docs" / "benchmarks.md").read_text(), flags=re.M))
    stems = {p.stem for p in (ROOT / "docs" / "results").glob("*.json")}
    assert stems and stems <= headings, sorted(stems - headings)


def test_a_result_file_without_a_description_gets_a_generic_table(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "zz_new_bench.json").write_text(
        '{"date": "2027-01-01", "median": {"a": 2.0, "b": 1.0}, "ratio_b_over_a": 0.5, "samples": [3, 1, 2]}'
    )
    page = _report().render(tmp_path / "results")
    assert "### zz_new_bench" in page and "## Other results" in page
    assert "| median | a | 2 |  |" in page and "| — | ratio_b_over_a |  | 0.5x |" in page
    assert "| — | samples (median of 3) | 2 |  |" in page and "date 2027-01-01" in page
    assert page == _report().render(tmp_path / "results")  # deterministic


def _anchors(path: Path) -> set[str]:
    """The heading ids MkDocs gives a page (the toc extension's slugs, ``_1`` ... for repeats)."""
    from markdown.extensions.toc import slugify

    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for title in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M):
        slug = slugify(re.sub(r"[`*]", "", title), "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}_{n}")
    return out


def test_links_into_the_benchmark_pages_resolve():
    targets = {name: _anchors(ROOT / "docs" / name) for name in ("benchmarks.md", "results-changelog.md")}
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text()
        for name, anchor in re.findall(r"(benchmarks\.md|results-changelog\.md)#([\w-]+)", text):
            if anchor not in targets[name]:
                broken.append(f"{page.relative_to(ROOT)}: {name}#{anchor}")
        if page.name in targets:
            broken += [
                f"{page.name}: #{a}" for a in re.findall(r"\]\(#([\w-]+)\)", text) if a not in targets[page.name]
            ]
    assert not broken, broken
