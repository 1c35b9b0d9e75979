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
from cluster.config_help import config_markdown

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
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def test_the_configuration_reference_is_the_schemas_current_output():
    assert (ROOT / "docs" / "reference" / "config.md").read_text() == config_markdown() + "\n", (
        "docs/reference/config.md is stale: rayrlhf config --markdown > docs/reference/config.md")


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
