"""``rayrlhf config``: every field with its default and meaning, and the JSON schema."""

from __future__ import annotations

import json

from cluster.config import Config, Section, StageConfig


def config_help() -> str:
    """Every field with its default and description, for ``rayrlhf config``."""
    lines = []
    for section, info in Config.model_fields.items():
        cls = info.annotation
        lines.append(f"{section}:")
        if not (isinstance(cls, type) and issubclass(cls, Section)):  # the stage list
            lines.append(f"  {info.description}\n  each stage: " + ", ".join(
                f"{n} ({f.description})" for n, f in StageConfig.model_fields.items()))
            continue
        if not cls.model_fields:  # type: ignore[union-attr]
            lines.append("  (no settings of its own) " + " ".join((cls.__doc__ or "").split()))
        lines.extend(_field_help(cls))
    return "\n".join(lines)


def _field_help(cls: type[Section], prefix: str = "") -> list[str]:
    """Help lines of a section's fields; a nested section's as dotted names (reward.remote.url)."""
    lines = []
    for name, f in cls.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, Section):
            lines.extend(_field_help(f.annotation, f"{prefix}{name}."))
            continue
        default = f.get_default(call_default_factory=True)
        lines.append(f"  {prefix}{name}: {default!r}\n      {f.description or ''}")
    return lines


def config_schema() -> str:
    return json.dumps(Config.model_json_schema(), indent=1)
