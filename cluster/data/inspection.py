"""``rayrlhf data inspect [SOURCE]``: a run's data as the model will see it.

For a run on prompts it loads them exactly as the run does (``cluster/data_sources.prompt_sets``: the same keys,
mixture, held-out split and load-time checks), renders each through the same call the
generators use (``actors/tasks.prompt_token_ids``) and applies the generators' length check, so
what it shows (text after the chat template, token ids and counts) and what it counts as skipped
are what a run would train on and skip. For preference pairs (dpo, reward_model with
``data.preference_file``) and demonstrations (sft or SPIN with ``data.demonstration_file``) it
loads and encodes them with the recipe's own functions and shows which tokens train. ``SOURCE``
replaces the config's ``data.task`` (and ``data.mix``), preference file or demonstration file.
"""

from __future__ import annotations

import json
from typing import Any

from cluster.config import Config, UserError

# Rows of a streamed source that inspect reads (it never reads the whole stream).
STREAM_SHOWN = 200


def inspect_prompts(cfg: Config, tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """The train and held-out prompts with their token ids, and the skip counts by reason."""
    from actors.data.tasks import prompt_token_ids
    from cluster.data.sources import prompt_sets

    train, held, described = prompt_sets(cfg)
    train_rows = train.rows
    if isinstance(train_rows, dict):  # streamed (data.streaming): the first rows of its first file
        from itertools import islice

        from actors.data.tables import iter_rows
        from actors.data.tasks import file_row, tag_source

        converted = (file_row(obj, train.keys, train.instruction, train.skipped) for obj in iter_rows(train.files[0]))
        train_rows = tag_source(
            list(islice((r for r in converted if r is not None), STREAM_SHOWN)), train.name or train.files[0].stem
        )
        described += f"; shown: the first {len(train_rows)} usable rows of {train.files[0].name}, unshuffled"
    budget = min(cfg.model.max_prompt_tokens, max_model_len - cfg.model.max_new_tokens)
    sources = [m.task for m in cfg.data.mix] or [cfg.data.task]
    applied = {task: cfg.data.instruction_for(task) for task in sources}
    out: dict[str, Any] = {
        "source": described,
        "max_prompt_tokens": budget,
        "instruction": applied,
        "skipped_at_load": dict(train.skipped),
        "splits": {},
    }
    for split, rows in (("train", train_rows), ("held_out", held.rows)):
        shown, too_long = [], 0
        for r in rows:
            try:
                ids = prompt_token_ids(
                    tokenizer, r["prompt"], r["meta"], cfg.data.system_prompt, cfg.data.chat_template
                )
            except ValueError as e:
                raise UserError(f"data: {e}") from None
            too_long += len(ids) > budget
            shown.append(
                {
                    "data_source": r["meta"].get("data_source"),
                    "prompt": r["prompt"],
                    "answer": r["answer"],
                    "tokens": len(ids),
                    "ids": ids,
                    "skipped": "prompt_too_long" if len(ids) > budget else None,
                }
            )
        out["splits"][split] = {"rows": shown, "prompt_too_long": too_long}
    return out


def data_kind(cfg: Config, named: bool = False) -> str:
    """What a run of this config trains on: ``preferences`` (a preference file for dpo or
    reward_model), ``demonstrations`` (a demonstration file for sft or SPIN) or ``prompts``.
    ``named``: a file given on the command line is the algorithm's file."""
    spin = cfg.run.algorithm == "dpo" and cfg.dpo.pairs == "spin"
    if cfg.run.algorithm in ("dpo", "reward_model") and not spin and (named or cfg.data.preference_file):
        return "preferences"
    if (cfg.run.algorithm == "sft" or spin) and (named or cfg.data.demonstration_file):
        return "demonstrations"
    return "prompts"


def inspect_offline(cfg: Config, tokenizer: Any, kind: str) -> dict[str, Any]:
    """Preference pairs or demonstrations as the learners get them: the recipe's own loading and
    encoding (``actors/data/offline_data.py``), each row's ids and the ids that train."""
    from actors.data.offline_data import encode_pairs
    from cluster.recipes import dpo, sft

    if kind == "preferences":
        train, held, described = dpo.load_data(cfg)
        encode = lambda rows: encode_pairs(  # noqa: E731 - dpo._encode without its console line
            rows,
            tokenizer,
            max_prompt_tokens=cfg.model.max_prompt_tokens,
            max_response_tokens=cfg.model.max_new_tokens,
            system_prompt=cfg.data.system_prompt,
        )
    else:
        train, held, described = sft.load_data(cfg)
        encode = lambda rows: (sft.encode(cfg, tokenizer, rows), None)  # noqa: E731
    out: dict[str, Any] = {"source": described, "kind": kind, "skipped_at_load": dict(train.skipped), "splits": {}}
    for split, rows in (("train", train.rows), ("held_out", held.rows)):
        exp, _ = encode(rows) if rows else (None, None)
        shown = []
        for i in range(exp.batch_size if exp is not None else 0):
            keep = exp.attention_mask[i].bool()
            ids, trained = exp.input_ids[i][keep].tolist(), exp.response_mask[i][keep].tolist()
            shown.append(
                {
                    "ids": ids,
                    "trained": [bool(t) for t in trained],
                    "tokens": len(ids),
                    "score": float(exp.scores[i]) if exp.scores is not None else None,
                }
            )
        per_row = 2 if kind == "preferences" else 1  # a pair is two rows, chosen and rejected
        out["splits"][split] = {"rows": shown, "too_long": len(rows) - len(shown) // per_row}
    return out


def render(report: dict[str, Any], tokenizer: Any, rows: int) -> str:
    """The report for a terminal: counts, then the first ``rows`` rows of each split as text."""
    lines = [f"source: {report['source']}", f"skipped while loading: {report['skipped_at_load'] or 'none'}"]
    if report.get("kind") in ("preferences", "demonstrations"):
        return _render_offline(report, tokenizer, rows, lines)
    lines.append(f"prompt budget: {report['max_prompt_tokens']} tokens after the chat template")
    for task, text in report.get("instruction", {}).items():
        lines.append(
            f"instruction appended to {task}'s text prompts: {text!r}"
            if text
            else f"no instruction appended to {task}'s prompts (data.instruction sets one)"
        )
    for split, part in report["splits"].items():
        n = len(part["rows"])
        sizes = sorted(r["tokens"] for r in part["rows"]) or [0]
        by_source: dict[str, int] = {}
        for r in part["rows"]:
            by_source[str(r["data_source"])] = by_source.get(str(r["data_source"]), 0) + 1
        lines.append(
            f"\n{split}: {n} rows {by_source}; tokens min {sizes[0]} / median {sizes[len(sizes) // 2]} / "
            f"max {sizes[-1]}; over the budget (skipped at generation): {part['prompt_too_long']}"
        )
        for i, r in enumerate(part["rows"][:rows]):
            flag = "  SKIPPED: prompt_too_long" if r["skipped"] else ""
            lines.append(
                f"--- {split}[{i}] source={r['data_source']} tokens={r['tokens']} answer={r['answer']!r}{flag}"
            )
            lines.append(tokenizer.decode(r["ids"]))
    return "\n".join(lines)


def _render_offline(report: dict[str, Any], tokenizer: Any, rows: int, lines: list[str]) -> str:
    """Pairs or demonstrations: each row's text with the trained tokens between ⟦ ⟧."""
    for split, part in report["splits"].items():
        lines.append(f"\n{split}: {len(part['rows'])} {report['kind']} rows; over the token budget: {part['too_long']}")
        for i, r in enumerate(part["rows"][:rows]):
            context = [t for t, trained in zip(r["ids"], r["trained"]) if not trained]
            target = [t for t, trained in zip(r["ids"], r["trained"]) if trained]
            label = "" if r["score"] is None else (" chosen" if r["score"] > 0 else " rejected")
            lines.append(f"--- {split}[{i}]{label} tokens={r['tokens']} (trained {len(target)})")
            lines.append(tokenizer.decode(context) + "⟦" + tokenizer.decode(target) + "⟧")
    return "\n".join(lines)


def main(config: str | None, overrides: list[str], source: str | None, rows: int, as_json: bool) -> int:
    """The CLI: one line and exit code 2 on a user error (as ``rayrlhf train``)."""
    from transformers import AutoTokenizer

    from cluster.assets import resolve_model
    from cluster.config.loading import load_config

    cfg = load_config(config, overrides)
    kind = data_kind(cfg, named=bool(source))
    if source:  # replaces what this config trains on
        key = {
            "prompts": "data.task",
            "preferences": "data.preference_file",
            "demonstrations": "data.demonstration_file",
        }[kind]
        cfg = load_config(
            config, list(overrides) + [f"{key}={source}"] + (["data.mix=[]"] if kind == "prompts" else [])
        )
    try:
        model_path = resolve_model(cfg.model.path, cfg.model.cache_dir or None)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    context = _model_context(model_path, cfg.model.max_prompt_tokens + cfg.model.max_new_tokens)
    report = inspect_prompts(cfg, tok, context) if kind == "prompts" else inspect_offline(cfg, tok, kind)
    if as_json:
        print(json.dumps(report))
    else:
        print(render(report, tok, rows))
    return 0


def _model_context(model_path: str, wanted: int) -> int:
    """The engine context a generator would get (``actors/generator._fit_context``'s rule)."""
    from actors.rollout.generator import _fit_context

    return _fit_context(model_path, wanted)
