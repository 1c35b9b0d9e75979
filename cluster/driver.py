"""The entry point behind ``rayrlhf train``: checks, run context, then the configured recipe,
or, for a config with ``stages``, each stage's recipe in turn.

The driver holds prompts, ObjectRefs and small stats dicts; experience tensors and weights move
between actors through the object store and never pass through this process.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import yaml

from cluster.ops.console import attach_run_dir
from cluster.config import Config, UserError
from cluster.config.loading import check_resume_compatible, load_config, stage_configs
from cluster.recipes import recipe_module
from cluster.run_context import RUN_STATE_FILE, RunContext, RunResult, latest_checkpoint, preflight

STAGES_DIR = "stages"


def train(cfg: Config, run_dir: str | Path | None = None, resume: bool = False) -> RunResult:
    """Runs ``cfg.run.algorithm``'s recipe (or ``cfg.stages``); ``resume`` continues ``run_dir``
    from its latest checkpoint. User errors (missing files, unknown task, broken reward) raise
    UserError before any actor starts."""
    if cfg.stages:
        return train_stages(cfg, run_dir, resume)
    model_path, train_set, eval_set, description = preflight(cfg)
    ctx = RunContext(cfg, run_dir, resume=resume)
    print(f"[rayrlhf] run directory: {ctx.dir.resolve()}", flush=True)
    print(f"[rayrlhf] {description}", flush=True)
    ctx.connect()
    try:
        return recipe_module(cfg.run.algorithm).run(ctx, model_path, train_set, eval_set)
    finally:
        ctx.close()


def stage_done(stage_dir: Path, cfg: Config) -> Path | None:
    """The stage's final checkpoint if the stage finished (its last step, or an early stop)."""
    ckpt = latest_checkpoint(stage_dir)
    if ckpt is None:
        return None
    state = json.loads((ckpt / "trainer_state" / RUN_STATE_FILE).read_text())
    finished = state["step"] >= cfg.run.steps or (state.get("early_stop") or {}).get("stopped")
    return ckpt if finished else None


def _pair_source(cfg: Config) -> tuple[str, ...] | None:
    """The rows a stage makes generated pairs from (None: it makes none)."""
    if cfg.run.algorithm not in ("dpo", "reward_model") or cfg.data.preference_file:
        return None
    if cfg.dpo.pairs == "spin" and cfg.data.demonstration_file:
        return ("demonstrations", cfg.data.demonstration_file)
    return ("task", cfg.data.task, json.dumps(cfg.data.task_kwargs, sort_keys=True), str(cfg.data.train_size))


def with_prompt_offset(cfg: Config, earlier: list[tuple[Path, Config]]) -> Config:
    """A stage that makes pairs starts its prompt stream after the prompts the earlier stages of
    the run drew from the same rows (their ``data/pairs_counts.json``), with ``dpo.fresh_prompts``."""
    source = _pair_source(cfg)
    if source is None or not cfg.dpo.fresh_prompts:
        return cfg
    offset = 0
    for stage_dir, stage_cfg in earlier:
        counts = stage_dir / "data" / "pairs_counts.json"
        if _pair_source(stage_cfg) == source and counts.is_file():
            offset += int(json.loads(counts.read_text()).get("prompts", 0))
    return cfg.model_copy(update={"dpo": cfg.dpo.model_copy(update={"prompt_offset": offset})})


def _load_stages(stages: list) -> list[tuple]:
    """Each stage's (model path, train set, held-out set, description); the first stage's
    preflight checks its model, the others' model is the stage before's checkpoint."""
    loaded = []
    for i, (name, scfg) in enumerate(stages):
        recipe = recipe_module(scfg.run.algorithm)
        if i == 0:
            model_path, train_set, eval_set, description = preflight(scfg)
        else:
            model_path = None
            train_set, eval_set, description = recipe.load_data(scfg)
        loaded.append((model_path, train_set, eval_set, description))
    return loaded


def train_stages(cfg: Config, run_dir: str | Path | None = None, resume: bool = False) -> RunResult:
    """Runs the stages one after another in ``<run dir>/stages/<NN>-<name>/``; each starts from
    the previous stage's final checkpoint (which is also its reference model). On resume,
    finished stages are skipped, a stage with a checkpoint continues from it, the rest start."""
    t0 = time.time()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    root = Path(run_dir) if run_dir else Path(cfg.run.output_dir) / f"{cfg.run.name}-{stamp}"
    stages = stage_configs(cfg)
    # Every stage's data and reward are checked before anything starts; the first stage's model too.
    loaded = _load_stages(stages)
    root.mkdir(parents=True, exist_ok=True)
    attach_run_dir(root)
    (root / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    print(
        f"[rayrlhf] run directory: {root.resolve()} ({len(stages)} stages: "
        f"{' -> '.join(f'{n} ({c.run.algorithm})' for n, c in stages)})",
        flush=True,
    )
    results: list[RunResult] = []
    previous: Path | None = None
    ctx = None
    try:
        for i, ((name, scfg), (model_path, train_set, eval_set, description)) in enumerate(zip(stages, loaded)):
            stage_dir = root / STAGES_DIR / f"{i:02d}-{name}"
            if previous is not None:  # model t+1 starts from, and is referenced to, model t
                scfg = scfg.model_copy(update={"model": scfg.model.model_copy(update={"path": str(previous)})})
                model_path = str(previous)
            earlier = [(root / STAGES_DIR / f"{j:02d}-{n}", c) for j, (n, c) in enumerate(stages[:i])]
            scfg = with_prompt_offset(scfg, earlier)
            done = stage_done(stage_dir, scfg)
            if done is not None:
                print(f"[rayrlhf] stage {i} ({name}): finished earlier, checkpoint {done}", flush=True)
                previous = done
                continue
            partial = latest_checkpoint(stage_dir) is not None
            if partial:
                check_resume_compatible(load_config(stage_dir / "config.yaml"), scfg)
            print(
                f"[rayrlhf] stage {i} ({name}, {scfg.run.algorithm}): {'resuming' if partial else 'starting'} "
                f"from {model_path}; {description}",
                flush=True,
            )
            stage_ctx = RunContext(scfg, stage_dir, resume=partial)
            if ctx is None:
                ctx = stage_ctx
                ctx.connect()  # one cluster for every stage
            result = recipe_module(scfg.run.algorithm).run(stage_ctx, model_path, train_set, eval_set)
            if result.final_checkpoint is None:
                raise UserError(f"stage {i} ({name}) left no checkpoint for the next stage (run.save_final is off?)")
            results.append(result)
            previous = result.final_checkpoint
    finally:
        if ctx is not None:
            ctx.close()
    print(f"[rayrlhf] {len(stages)} stages done in {time.time() - t0:.0f}s; final checkpoint: {previous}", flush=True)
    return RunResult(root, results[-1].history if results else [], previous, time.time() - t0, stages=results)
