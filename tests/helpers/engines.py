"""Test engines' configs (``tests/conftest.py``'s fixtures and tests that build their own engine)."""

from __future__ import annotations


def engine_config(model_path: str, max_len: int):
    """A test engine's config (fp32, seed 0) whose context is exactly ``max_len``: its prompt and
    reply limits, which here only size the context (``generate`` takes its own per call), fit in it."""
    from actors.rollout.generator import GeneratorConfig

    return GeneratorConfig(
        model_path,
        dtype="float32",
        max_model_len=max_len,
        max_prompt_tokens=max_len // 2,
        max_new_tokens=max_len - max_len // 2,
        seed=0,
    )
