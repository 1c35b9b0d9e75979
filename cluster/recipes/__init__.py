"""One readable step per algorithm, and the registry that finds it. ``run.algorithm`` picks the
recipe; the recipe names the learner it trains (``learners.base.LEARNERS``).

A recipe module declares ``RECIPE = Recipe(...)`` (a module serving two algorithms declares one
per name, ``RECIPES`` below says which): the learner, the config section it reads, the roles it
holds (``roles(cfg) -> RoleSet``: resources, placement and start-up all read it), the size of a
step's batch and its own config checks. It provides ``load_data(cfg) -> (train, held_out,
description)``, called before anything starts (a user error there raises ``UserError``; data
comes through ``cluster/data/sources.py``), and ``run(ctx, model_path, train, held_out) ->
RunResult``, which starts its roles (``cluster/roles/__init__.py``) and runs the shared loop
(``cluster/step_loop.py``) over its step object. No recipe imports another; ``fixed_data.py``
(the step over a fixed data set) and ``pairs.py`` (pairs the generators make) are helpers, not
recipes.

Adding an algorithm: its learner file (registered in ``learners.base.LEARNERS``), its recipe file
(or a reused one) declaring ``RECIPE``, its config section, and one line in ``RECIPES``. A
package outside this repository registers with ``register_recipe`` and ``register_learner``
from a module named in ``run.plugins`` (its section: ``Recipe.section_model``).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Literal

#: Algorithm name -> the module of its recipe, or ``module:NAME`` for a declaration other than
#: ``RECIPE`` (imported on use).
RECIPES: dict[str, str] = {
    "ppo": "cluster.recipes.ppo",
    "dpo": "cluster.recipes.dpo",
    "sft": "cluster.recipes.sft",
    "qlearn": "cluster.recipes.qlearn",
    "reward_model": "cluster.recipes.dpo:REWARD_MODEL",
}

#: Where a recipe's reference model runs. ``rollout``: an actor beside the generators that scores
#: every batch; ``data``: an actor that scores the recipe's fixed data once, before training;
#: ``learners``: the learners compute it (a frozen copy, or LoRA's base model); ``none``.
ReferenceWhere = Literal["none", "rollout", "data", "learners"]


@dataclass(frozen=True)
class RoleSet:
    """The roles a run of a recipe holds (an upper bound: a role it may start counts)."""

    # A generator pool (rollout.num_generators actors, or one per learner when colocated).
    generators: bool = True
    # The reward scorer beside the generators (none when the generators judge themselves).
    scorer: bool = True
    reference: ReferenceWhere = "none"
    # The Ray Train learner workers (cluster.num_learners).
    learners: bool = True
    # A replay-buffer actor between the generators and the learners.
    replay: bool = False


Check = tuple[bool, str]

#: What a recipe may declare it supports: cluster.layout=colocated, train.sharding=fsdp, episodes
#: (env.name, rollout.agent), data.streaming, rollout.inflight_updates, rollout.dynamic_sampling.
FEATURES = frozenset({"colocated", "fsdp", "episodes", "streaming", "inflight_updates", "dynamic_sampling"})


def _no_checks(cfg: Any) -> list[Check]:
    return []


@dataclass(frozen=True)
class Recipe:
    """What the rest of the framework needs to know of an algorithm, declared once."""

    name: str
    # ``learners.base.LEARNERS`` name of the learner it trains.
    learner: str
    # The config section its learner reads (``cfg.<section>``).
    section: str
    # roles(cfg) -> RoleSet.
    roles: Callable[[Any], RoleSet]
    # batch(cfg) -> (rows per step, their unit, e.g. "pairs"), for the config's checks.
    batch: Callable[[Any], tuple[int, str]]
    # check(cfg) -> [(ok, message)]: the recipe's own cross-field rules.
    check: Callable[[Any], list[Check]] = _no_checks
    # Settings it is built for, of ``FEATURES`` (the shared checks refuse the others).
    features: frozenset[str] = frozenset({"fsdp"})
    # A pydantic model of its section when that is not a field of ``Config`` (a plugin's).
    section_model: Any = None
    # Module of ``run`` and ``load_data`` (set by the registry).
    module: str = field(default="", compare=False)


_LOADED: dict[str, Recipe] = {}


#: Names registered by ``register_recipe`` (a plugin's), as against the built-in ``RECIPES``.
_REGISTERED: set[str] = set()


def register_recipe(name: str, target: str) -> None:
    """Registers (or replaces) a recipe: ``target`` as in ``RECIPES``."""
    RECIPES[name] = target
    _REGISTERED.add(name)
    _LOADED.pop(name, None)


def unregister_recipe(name: str) -> None:
    RECIPES.pop(name, None)
    _REGISTERED.discard(name)
    _LOADED.pop(name, None)


class UnknownRecipe(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def get_recipe(name: str) -> Recipe:
    """The registered recipe of ``name``; UnknownRecipe (one line naming the registered ones)
    otherwise, or when its module declares something else."""
    if name not in RECIPES:
        raise UnknownRecipe(f"run.algorithm must be one of {', '.join(sorted(RECIPES))}, got {name!r}")
    if name not in _LOADED:
        module, _, attr = RECIPES[name].partition(":")
        declared = getattr(importlib.import_module(module), attr or "RECIPE", None)
        if not isinstance(declared, Recipe) or declared.name != name:
            raise UnknownRecipe(f"recipe {name!r}: {module} declares no Recipe(name={name!r}) as {attr or 'RECIPE'}")
        _LOADED[name] = _with_module(declared, module)
    return _LOADED[name]


def _with_module(recipe: Recipe, module: str) -> Recipe:
    unknown = set(recipe.features) - FEATURES
    if unknown:
        raise UnknownRecipe(
            f"recipe {recipe.name!r}: unknown features {sorted(unknown)}; known: {', '.join(sorted(FEATURES))}"
        )
    return dataclasses.replace(recipe, module=module)


def supporting(feature: str) -> str:
    """The registered recipes that support ``feature``, for a message ("ppo, qlearn")."""
    names = [name for name in sorted(RECIPES) if feature in get_recipe(name).features]
    return ", ".join(names) or "(none registered)"


def reference_where(cfg: Any, needed: bool) -> ReferenceWhere:
    """Where a reference that a recipe's terms need (``needed``) runs by the shared settings:
    in the learners with LoRA (its base model) or train.reference=learners, else an actor."""
    if not needed:
        return "none"
    return "learners" if cfg.lora.enabled or cfg.train.reference == "learners" else "rollout"


def recipe_module(name: str) -> ModuleType:
    """The module holding ``name``'s ``run`` and ``load_data``."""
    return importlib.import_module(get_recipe(name).module)


def plugin_sections() -> dict[str, Any]:
    """Config sections of registered plugins' recipes, which ``Config`` does not define (section ->
    model). Built-in recipes' sections are ``Config`` fields: their modules are not imported here."""
    recipes = [get_recipe(name) for name in sorted(_REGISTERED)]
    return {r.section: r.section_model for r in recipes if r.section_model is not None}
