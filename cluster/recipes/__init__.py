"""One readable training loop per algorithm. ``run.algorithm`` picks the recipe; each recipe
names the learner it trains (``learners.base.LEARNERS``)."""

from __future__ import annotations

import importlib
from typing import Callable

#: Algorithm name -> "module:function" of its recipe (imported on use).
RECIPES: dict[str, str] = {
    "ppo": "cluster.recipes.ppo:run",
}


def get_recipe(name: str) -> Callable:
    module, fn = RECIPES[name].split(":")
    return getattr(importlib.import_module(module), fn)
