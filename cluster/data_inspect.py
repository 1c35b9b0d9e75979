"""``rayrlhf data inspect [SOURCE]``: a run's prompts as the model will see them.

It loads the prompts exactly as a run does (``cluster/data_sources.prompt_sets``: the same keys,
mixture, held-out split and load-time checks), renders each through the same call the
generators use (``actors/tasks.prompt_token_ids``) and applies the generators' length check, so
what it shows (text after the chat template, token ids and counts) and what it counts as skipped
are what a run would train on and skip. ``SOURCE`` (a task name or a data file) replaces
``data.task`` / ``data.mix`` of the config.
"""

from __future__ import annotations

import json
from typing import Any

from cluster.config import Config, UserError


def inspect_prompts(cfg: Config, tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """The train and held-out prompts with their token ids, and the skip counts by reason."""
    from actors.tasks import prompt_token_ids
    from cluster.data_sources import prompt_sets

    train, held, described = prompt_sets(cfg)
    budget = min(cfg.model.max_prompt_tokens, max_model_len - cfg.model.max_new_tokens)
    out: dict[str, Any] = {"source": described, "max_prompt_tokens": budget,
                           "skipped_at_load": dict(train.skipped), "splits": {}}
    for split, rows in (("train", train.rows), ("held_out", held.rows)):
        shown, too_long = [], 0
        for r in rows:
            try:
                ids = prompt_token_ids(tokenizer, r["prompt"], r["meta"], cfg.data.system_prompt, cfg.data.chat_template)
            except ValueError as e:
                raise UserError(f"data: {e}") from None
            too_long += len(ids) > budget
            shown.append({"data_source": r["meta"].get("data_source"), "prompt": r["prompt"], "answer": r["answer"],
                          "tokens": len(ids), "ids": ids, "skipped": "prompt_too_long" if len(ids) > budget else None})
        out["splits"][split] = {"rows": shown, "prompt_too_long": too_long}
    return out


def render(report: dict[str, Any], tokenizer: Any, rows: int) -> str:
    """The report for a terminal: counts, then the first ``rows`` rows of each split as text."""
    lines = [f"source: {report['source']}",
             f"skipped while loading: {report['skipped_at_load'] or 'none'}",
             f"prompt budget: {report['max_prompt_tokens']} tokens after the chat template"]
    for split, part in report["splits"].items():
        n = len(part["rows"])
        sizes = sorted(r["tokens"] for r in part["rows"]) or [0]
        by_source: dict[str, int] = {}
        for r in part["rows"]:
            by_source[str(r["data_source"])] = by_source.get(str(r["data_source"]), 0) + 1
        lines.append(f"\n{split}: {n} rows {by_source}; tokens min {sizes[0]} / median {sizes[len(sizes) // 2]} / "
                     f"max {sizes[-1]}; over the budget (skipped at generation): {part['prompt_too_long']}")
        for i, r in enumerate(part["rows"][:rows]):
            flag = "  SKIPPED: prompt_too_long" if r["skipped"] else ""
            lines.append(f"--- {split}[{i}] source={r['data_source']} tokens={r['tokens']} answer={r['answer']!r}{flag}")
            lines.append(tokenizer.decode(r["ids"]))
    return "\n".join(lines)


def main(config: str | None, overrides: list[str], source: str | None, rows: int, as_json: bool) -> int:
    """The CLI: one line and exit code 2 on a user error (as ``rayrlhf train``)."""
    from transformers import AutoTokenizer

    from cluster.assets import resolve_model
    from cluster.config_loading import load_config

    if source:
        overrides = [f"data.task={source}", "data.mix=[]"] + list(overrides)
    cfg = load_config(config, overrides)
    try:
        model_path = resolve_model(cfg.model.path, cfg.model.cache_dir or None)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    context = _model_context(model_path, cfg.model.max_prompt_tokens + cfg.model.max_new_tokens)
    report = inspect_prompts(cfg, tok, context)
    if as_json:
        print(json.dumps(report))
    else:
        print(render(report, tok, rows))
    return 0


def _model_context(model_path: str, wanted: int) -> int:
    """The engine context a generator would get (``actors/generator._fit_context``'s rule)."""
    from actors.generator import _fit_context

    return _fit_context(model_path, wanted)
