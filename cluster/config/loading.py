"""Reading a run's configuration: a YAML preset, ``section.key=value`` overrides, the stages
merged into full configs of their own, and the check that a resumed run did not change what its
checkpoint cannot carry over. Errors name the offending key (``ConfigError``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cluster.config import IMMUTABLE_ON_RESUME, MOVED_KEYS, Config, ConfigError, StageConfig


def _format_error(err: ValidationError, data: dict, root: Any = Config, prefix: tuple[str, ...] = ()) -> str:
    """One line naming every bad key; ``root``: the model validated, found under ``prefix`` (a
    plugin's section) in the config."""
    msgs = []
    for e in err.errors():
        inner = [str(x) for x in e["loc"]]
        loc = [*prefix, *inner]
        key = ".".join(loc)
        if e["type"] == "extra_forbidden":
            moved = MOVED_KEYS.get(key)
            if moved:
                msgs.append(f"config key {key!r} has moved to {moved}")
                continue
            section_cls: Any = root
            for part in inner[:-1]:
                if part.isdigit():  # an item of the stage list
                    section_cls = StageConfig
                    continue
                section_cls = section_cls.model_fields[part].annotation
            valid = ", ".join(sorted(getattr(section_cls, "model_fields", {})))
            where = f" in section '{'.'.join(loc[:-1])}'" if len(loc) > 1 else ""
            msgs.append(f"unknown config key {key!r}{where}; valid keys: {valid}")
        elif e["type"] == "value_error" and key and str(e.get("ctx", {}).get("error", "")).startswith(key):
            msgs.append(str(e["ctx"]["error"]))  # a validator's own message, which names its key
        else:
            got = e.get("input")
            msgs.append(f"{key}: {e['msg']} (got {got!r})" if key else e["msg"])
    return "; ".join(msgs)


def build_config(data: dict) -> Config:
    """Validates a nested mapping into a Config (ConfigError names every bad key)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(data).__name__}")
    for name, section in data.items():
        if section is None:
            data[name] = {}
    import_plugins(data)
    _check_plugin_sections(data)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e, data)) from None
    cfg = cfg.validate_run()
    stage_configs(cfg)  # every stage validated now, not when it starts
    _resolve_generator_dtype(cfg)
    return cfg


def import_plugins(data: dict) -> None:
    """Imports ``run.plugins`` (their registrations must exist before the rest is read)."""
    import importlib

    plugins = (data.get("run") or {}).get("plugins") or []
    for name in [p.strip() for p in plugins.split(",")] if isinstance(plugins, str) else plugins:
        try:
            importlib.import_module(str(name))
        except ImportError as e:
            raise ConfigError(f"run.plugins: cannot import {name!r}: {e}") from None


def _check_plugin_sections(data: dict) -> None:
    """A registered plugin's section (``Recipe.section_model``), with errors worded as the built-in ones'."""
    from cluster.recipes import plugin_sections

    for name, model in plugin_sections().items():
        try:
            model.model_validate(data.get(name) or {})
        except ValidationError as e:
            raise ConfigError(_format_error(e, data, root=model, prefix=(name,))) from None


def _resolve_generator_dtype(cfg: Config) -> None:
    """``model.generator_dtype: auto`` as the dtype the engines load, decided here once: the
    learners pack the weights they sync in it and the sync check's tolerance depends on it."""
    from learners.training.precision import resolve_engine_dtype

    cfg.model.generator_dtype = resolve_engine_dtype(
        cfg.model.generator_dtype, uses_gpu=cfg.rollout.gpus_per_generator > 0
    )


def _set_dotted(data: dict, dotted: str, value: Any, where: str = "") -> None:
    parts = dotted.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{where}override {dotted!r}: {part!r} is not a section")
    node[parts[-1]] = value


def _apply_override(data: dict, assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like section.key=value")
    dotted, raw = assignment.split("=", 1)
    _set_dotted(data, dotted, yaml.safe_load(raw) if raw.strip() else "")


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    loaded = yaml.safe_load(p.read_text())
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections")
    return loaded or {}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, base: dict | None = None) -> Config:
    """Reads a YAML preset (or ``base``, or the defaults), applies ``section.key=value`` overrides,
    validates."""
    data: dict = copy.deepcopy(base or {})
    if path is not None:
        data = read_yaml(path)
    for assignment in overrides or []:
        _apply_override(data, assignment)
    return build_config(data)


def check_resume_compatible(saved: Config, new: Config) -> None:
    """Refuses a resumed config that changes what a checkpoint cannot carry over."""
    keys = [k for k in IMMUTABLE_ON_RESUME if not k.startswith("lora.") or k == "lora.enabled" or saved.lora.enabled]
    changed = [k for k in keys if saved.get(k) != new.get(k)]
    if changed:
        raise ConfigError(
            "cannot resume with a different "
            + ", ".join(f"{k} ({saved.get(k)!r} -> {new.get(k)!r})" for k in changed)
            + ": start a new run instead"
        )


def stage_configs(cfg: Config) -> list[tuple[str, Config]]:
    """Each stage's full config: this one without ``stages``, the stage's changes applied,
    ``run.name`` set to the stage's name. (Its ``model.path`` is replaced at run time by the
    previous stage's checkpoint.)"""
    base = cfg.to_dict()
    base.pop("stages")
    out = []
    for i, stage in enumerate(cfg.stages):
        data = copy.deepcopy(base)
        data["run"]["name"] = stage.name
        for dotted, value in stage.set.items():
            if dotted == "stages" or dotted.startswith("stages."):
                raise ConfigError(f"stages[{i}] ({stage.name}): a stage cannot hold stages")
            _set_dotted(data, dotted, value, where=f"stages[{i}] ({stage.name}): ")
        try:
            out.append((stage.name, build_config(data)))
        except ConfigError as e:
            raise ConfigError(f"stages[{i}] ({stage.name}): {e}") from None
    return out
