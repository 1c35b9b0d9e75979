"""The entry point behind ``rayrlhf train``: checks, run context, then the configured recipe.

The driver holds prompts, ObjectRefs and small stats dicts; experience tensors and weights move
between actors through the object store and never pass through this process.
"""

from __future__ import annotations

from pathlib import Path

from cluster.config import Config
from cluster.recipes import get_recipe
from cluster.run_context import RunContext, RunResult, preflight


def train(cfg: Config, run_dir: str | Path | None = None, resume: bool = False) -> RunResult:
    """Runs ``cfg.run.algorithm``'s recipe; ``resume`` continues ``run_dir`` from its latest
    checkpoint. User errors (missing files, unknown task, broken reward) raise UserError before
    any actor starts."""
    model_path, train_set, eval_set, description = preflight(cfg)
    ctx = RunContext(cfg, run_dir, resume=resume)
    print(f"[rayrlhf] run directory: {ctx.dir.resolve()}", flush=True)
    print(f"[rayrlhf] {description}", flush=True)
    ctx.connect()
    try:
        return get_recipe(cfg.run.algorithm).run(ctx, model_path, train_set, eval_set)
    finally:
        ctx.close()
