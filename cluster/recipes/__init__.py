"""One readable step per algorithm. ``run.algorithm`` picks the recipe; each recipe names the
learner it trains (``learners.base.LEARNERS``).

A recipe module provides ``load_data(cfg) -> (train, held_out, description)``, called before
anything starts (a user error there raises ``UserError``; data comes through
``cluster/data_sources.py``), and ``run(ctx, model_path, train, held_out) -> RunResult``, which
starts its roles (``cluster/roles.py``) and runs the shared loop (``cluster/step_loop.py``) over
its step object. No recipe imports another; ``fixed_data.py`` (the step over a fixed data set)
and ``pairs.py`` (pairs the generators make) are helpers, not recipes.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: Algorithm name -> module of its recipe (imported on use).
RECIPES: dict[str, str] = {
    "ppo": "cluster.recipes.ppo",
    "dpo": "cluster.recipes.dpo",
    "sft": "cluster.recipes.sft",
    "qlearn": "cluster.recipes.qlearn",
    "reward_model": "cluster.recipes.dpo",
}


def get_recipe(name: str) -> ModuleType:
    return importlib.import_module(RECIPES[name])
