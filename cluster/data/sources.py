"""Where a run's units come from, loaded and checked before anything starts (a user error
raises ``UserError`` with one line): task prompts (``data.task``: a reasoning-gym task or a
``jsonl:`` file) and demonstrations (``data.demonstration_file``, or a task's reference
answers). Every recipe reads its data through here, so no recipe imports another.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.config import Config, DataSourceConfig, UserError


def load_task_prompts(cfg: Config) -> tuple[Any, Any, str]:
    """Train and held-out prompts of ``data.task``; checks that the reward function imports and
    that a reward model folder exists."""
    from actors.rewards.scorer import resolve_reward_fn
    from actors.rewards.scorer_factory import SCORER_KINDS

    if cfg.env.name.startswith("verifiers:"):  # the environment's taskset is the prompt set
        return verifiers_prompts(cfg)
    if cfg.env.name:
        check_environment(cfg)
    if cfg.rollout.agent:
        from actors.agents.agent_endpoint import resolve_agent

        try:
            resolve_agent(cfg.rollout.agent)
        except ValueError as e:
            raise UserError(str(e)) from None
    if cfg.env.name == "guess_number":  # the game makes its own prompts
        return environment_prompts(cfg)
    train_set, eval_set, described = prompt_sets(cfg)
    functions = [c.function for c in cfg.reward.components] + [
        c.function for comps in cfg.reward.by_source.values() for c in comps
    ]
    for name in functions or ([cfg.reward.function] if cfg.reward.function not in SCORER_KINDS else []):
        try:  # a rule function: it must import
            resolve_reward_fn(name)
        except ValueError as e:
            raise UserError(f"reward: {e}") from None
    if cfg.reward.model and not (Path(cfg.reward.model) / "config.json").is_file():
        raise UserError(f"reward.model: {cfg.reward.model} is not a model folder (no config.json)")
    _warn_unrouted(cfg, train_set, eval_set)
    if cfg.data.streaming:  # its size is counted once the cluster is up
        return train_set, eval_set, f"{len(eval_set)} held-out prompts; train prompts from {described}"
    description = f"{len(train_set)} train / {len(eval_set)} held-out prompts from {described}" + (
        f" (skipped while loading: {train_set.skipped})" if train_set.skipped else ""
    )
    return train_set, eval_set, description


def _warn_unrouted(cfg: Config, train_set: Any, eval_set: Any) -> None:
    """One line when ``reward.by_source`` has no entry for sources the data holds (a typo would
    otherwise drop each of their samples, counted as ``reward_unmapped_source``)."""
    if not cfg.reward.by_source:
        return
    from actors.data.tables import column

    rows = list(eval_set.rows) + (list(train_set.rows) if isinstance(train_set.rows, list) else [])
    found = {str(column(r["meta"], cfg.reward.source_key)) for r in rows}
    missing = sorted(found - set(cfg.reward.by_source))
    if missing:
        print(
            f"[rayrlhf] reward.by_source has no entry for {missing} (the data's {cfg.reward.source_key} values): "
            f"their samples will be dropped and counted as reward_unmapped_source",
            flush=True,
        )


def prompt_sets(cfg: Config) -> tuple[Any, Any, str]:
    """Train and held-out prompts of ``data.task`` or of the ``data.mix`` sources (each source's
    share by weight, rows tagged with their ``data_source``), the held-out ones from
    ``data.eval_task`` when set; and where they came from, in words."""
    from actors.data.tasks import PromptSet, tag_source, weighted_counts

    d = cfg.data
    if d.streaming:
        return _streamed(cfg)
    sources = d.mix or [DataSourceConfig(task=d.task)]
    n_eval = 0 if d.eval_task else d.eval_size
    train_n = weighted_counts(d.train_size, [s.weight for s in sources])
    eval_n = weighted_counts(n_eval, [s.weight for s in sources])
    train, held, skipped = [], [], {}
    for k, (src, n_train, n_held) in enumerate(zip(sources, train_n, eval_n)):
        t, h = _source_prompts(cfg, src, n_train, n_held, cfg.run.seed + 7919 * k)
        name = src.name or _source_name(src.task)
        train += tag_source(t.rows, name, bool(src.name))
        held += tag_source(h.rows, name, bool(src.name))
        for r, n in t.skipped.items():
            skipped[r] = skipped.get(r, 0) + n
    if d.eval_task:
        held = _eval_source(cfg)
        seen = {r["prompt"] for r in held}
        train = [r for r in train if r["prompt"] not in seen]
    if not train:
        raise UserError(f"data: no usable training prompts ({skipped})")
    if not d.chat_template and any(r["meta"].get("messages") for r in train + held):
        raise UserError(
            "data.chat_template=false: some prompts are chat messages, which only the chat template renders"
        )
    if len(sources) > 1:
        random.Random(cfg.run.seed).shuffle(train)
    described = " + ".join(f"{s.task} ({n})" for s, n in zip(sources, train_n)) if d.mix else d.task
    return PromptSet(train, skipped), PromptSet(held), described + (f"; held out: {d.eval_task}" if d.eval_task else "")


def _streamed(cfg: Config) -> tuple[Any, Any, str]:
    """``data.streaming``: the train rows streamed by Ray Data once the run's cluster is up
    (``cluster/data/streaming.py``); the held-out rows loaded now."""
    from actors.data.tasks import FileKeys, is_file_task, tag_source
    from cluster.data.streaming import streaming_sets

    d = cfg.data
    if not is_file_task(d.task):
        raise UserError(f"data.streaming reads a data file or folder; data.task={d.task!r} is not one")
    try:
        train, held = streaming_sets(
            d.task,
            FileKeys(d.prompt_key, d.answer_key),
            d.instruction_for(d.task),
            cfg.run.seed,
            d.eval_size,
            _eval_source(cfg) if d.eval_task else None,
            d.shuffle_buffer,
            _source_name(d.task),
        )
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"data.task: {e}") from None
    tag_source(held.rows, _source_name(d.eval_task or d.task))
    return train, held, f"{d.task} (streamed with Ray Data, {len(train.files)} files)"


def _source_prompts(cfg: Config, src: DataSourceConfig, n_train: int, n_held: int, seed: int) -> tuple[Any, Any]:
    """One source's train and held-out rows (``actors/tasks.load_prompts``); one line on a bad source."""
    from actors.data.tasks import FileKeys, PromptSet, load_prompts

    if n_train <= 0:
        return PromptSet([]), PromptSet([])
    d = cfg.data
    keys = FileKeys(prompt=src.prompt_key or d.prompt_key, answer=src.answer_key or d.answer_key)
    kwargs = d.task_kwargs if src.task_kwargs is None else src.task_kwargs
    where = f"data.mix[{src.task}]" if d.mix else "data.task"
    try:
        return load_prompts(src.task, n_train, n_held, seed, kwargs, d.instruction_for(src.task), keys)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"{where}: {e}") from None


def _eval_source(cfg: Config) -> list[dict[str, Any]]:
    """``data.eval_task``'s first ``eval_size`` rows (a file in its own order; a task generated
    with the held-out seed)."""
    from actors.data.tasks import FileKeys, file_rows, is_file_task, reasoning_gym_rows, tag_source

    d = cfg.data
    try:
        if is_file_task(d.eval_task):
            rows = file_rows(d.eval_task, d.instruction_for(d.eval_task), FileKeys(d.prompt_key, d.answer_key)).rows
        else:
            rows = reasoning_gym_rows(
                d.eval_task, d.eval_size, cfg.run.seed + 1_000_003, d.task_kwargs, d.instruction_for(d.eval_task)
            ).rows
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"data.eval_task: {e}") from None
    return tag_source(rows[: d.eval_size], _source_name(d.eval_task))


def _source_name(task: str) -> str:
    """A source's default ``data_source``: a task's name, a file's or folder's stem."""
    from actors.data.tasks import is_file_task

    if not is_file_task(task):
        return task
    from actors.data.tables import source_path

    return source_path(task)[0].stem


def check_environment(cfg: Config) -> None:
    """``env.name`` builds (a typo, a module that does not import: one line before anything starts)."""
    from actors.agents.environments import environment_factory
    from cluster.config.role_settings import episode_settings

    try:
        environment_factory(episode_settings(cfg)["environment"])
    except (ValueError, TypeError) as e:
        raise UserError(f"env.name: {e}") from None


def verifiers_prompts(cfg: Config) -> tuple[Any, Any, str]:
    """A verifiers environment's tasks: the last ``data.eval_size`` held out, up to
    ``data.train_size`` of the others to train on (a load failure is one line)."""
    from actors.data.tasks import PromptSet
    from actors.agents.verifiers_env import load_environment, task_rows

    env_id = cfg.env.name[len("verifiers:") :]
    try:
        rows = task_rows(load_environment(env_id, dict(cfg.env.args)))
    except ValueError as e:
        raise UserError(f"env.name: {e}") from None
    n_eval = min(cfg.data.eval_size, len(rows) - 1)
    train, held = rows[: len(rows) - n_eval][: cfg.data.train_size], rows[len(rows) - n_eval :]
    if not train:
        raise UserError(f"env.name: the verifiers environment {env_id} has {len(rows)} task(s): none left to train on")
    return PromptSet(train), PromptSet(held), f"{len(train)} train / {len(held)} held-out tasks of verifiers:{env_id}"


def environment_prompts(cfg: Config) -> tuple[Any, Any, str]:
    """The guessing game's rows: train and held-out targets from two seeds."""
    from actors.agents.environments import GuessNumber
    from actors.data.tasks import PromptSet

    args = {k: v for k, v in cfg.env.args.items() if k in ("low", "high", "max_guesses")}
    train = PromptSet(GuessNumber.make_rows(cfg.data.train_size, cfg.run.seed, **args))
    held = PromptSet(GuessNumber.make_rows(cfg.data.eval_size, cfg.run.seed + 1_000_003, **args))
    return train, held, f"{len(train)} train / {len(held)} held-out games of guess_number {args or ''}".rstrip()


@dataclass
class Demonstrations:
    # {"prompt": messages, "response": str, "index": int} or {"messages", "tools", "index"}
    rows: list[dict[str, Any]]
    # Rows excluded while loading, by reason.
    skipped: dict[str, int] = field(default_factory=dict)
    # Held-out task rows (prompt, answer, meta) for greedy accuracy; empty for a file.
    task_rows: list[dict[str, Any]] = field(default_factory=list)


def load_demonstrations(cfg: Config) -> tuple[Demonstrations, Demonstrations, str]:
    """Train and held-out demonstrations of ``data.demonstration_file`` (seeded shuffle, split),
    or of ``data.task`` (its answers as responses, plus judge demonstrations when asked)."""
    from actors.data.offline_data import read_demonstrations, split_rows, task_demonstrations

    if not cfg.data.demonstration_file:
        train_set, eval_set, description = load_task_prompts(cfg)
        if cfg.sft.transcripts:
            return _transcripts(cfg, train_set, eval_set, description)
        demos = task_demonstrations(train_set.rows)
        if cfg.sft.judge_demonstrations:
            from actors.rewards.judge import judge_demonstrations

            eft = judge_demonstrations(
                train_set.rows,
                cfg.sft.judge_demonstrations,
                cfg.judge.template,
                seed=cfg.run.seed,
                max_score=cfg.judge.max_score,
                min_points=max(cfg.judge.min_score, 1.0),
            )
            demos = demos + [dict(r, index=len(demos) + i) for i, r in enumerate(eft)]
            description += f"; {len(eft)} judge demonstrations (EFT)"
        return (
            Demonstrations(demos, dict(train_set.skipped)),
            Demonstrations(task_demonstrations(eval_set.rows), {}, list(eval_set.rows)),
            description + "; demonstrations: the task's reference answers",
        )
    try:
        demos = read_demonstrations(cfg.data.demonstration_file)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"data.demonstration_file: {e}") from None
    train, held = split_rows(demos.rows, cfg.run.seed, cfg.data.eval_size)
    if not train:
        raise UserError(f"data.demonstration_file: no usable training rows (skipped while loading: {demos.skipped})")
    return (
        Demonstrations(train, demos.skipped),
        Demonstrations(held),
        f"{len(train)} train / {len(held)} held-out demonstrations from {cfg.data.demonstration_file}"
        + (f" (skipped while loading: {demos.skipped})" if demos.skipped else ""),
    )


def _transcripts(
    cfg: Config, train_set: Any, eval_set: Any, description: str
) -> tuple[Demonstrations, Demonstrations, str]:
    """Tool-use conversations written by ``sft.transcripts`` from the task's rows, listing the
    tools of ``env.tools`` as the multi-turn stage after it does (``actors/agents/transcripts.py``)."""
    from actors.agents.tools import ToolBox, resolve_tools
    from actors.agents.transcripts import resolve_transcripts, transcript_demonstrations

    try:
        make = resolve_transcripts(cfg.sft.transcripts)
        tools = ToolBox(
            resolve_tools(
                cfg.env.tools or ["calculator"],
                cfg.env.python_sandbox,
                tuple(cfg.env.python_packages),
                tuple(cfg.env.sandbox_tools),
            ),
            workers=1,
        )
    except ValueError as e:
        raise UserError(f"sft.transcripts: {e}") from None
    schemas = tools.schemas()
    tools.close()
    train, skipped = transcript_demonstrations(train_set.rows, make, schemas)
    held, _ = transcript_demonstrations(eval_set.rows, make, schemas)
    if not train:
        raise UserError(
            f"sft.transcripts={cfg.sft.transcripts}: no transcript written for any of the "
            f"{len(train_set.rows)} rows of data.task ({skipped})"
        )
    skipped = {**dict(train_set.skipped), **skipped}
    return (
        Demonstrations(train, skipped),
        Demonstrations(held, {}, list(eval_set.rows)),
        description
        + f"; {len(train)} {cfg.sft.transcripts} transcripts"
        + (f" (skipped: {skipped})" if skipped else ""),
    )
