"""One readable training loop per algorithm. ``run.algorithm`` picks the recipe; each recipe
names the learner it trains (``learners.base.LEARNERS``).

A recipe module provides ``load_data(cfg) -> (train, held_out, description)``, called before
anything starts (a user error there raises ``UserError``), and ``run(ctx, model_path, train,
held_out) -> RunResult``, the loop itself.
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
