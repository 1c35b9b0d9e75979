"""Scoring: the scorer role (scorer, scorer_factory), built-in reward functions (functions), reward models (reward_model), an LLM judge (judge), a remote reward service (remote) and per-source routing of rewards (routing). A reward that raises, hangs or returns garbage is a counted skip, never a NaN in a loss."""

# The built-in reward functions, also as ``actors.rewards:<name>`` (as configs name them).
from actors.rewards.functions import (  # noqa: E402, F401
    BUILTIN_REWARDS,
    digit_density,
    environment,
    exact_match,
    extract_final_answer,
    reasoning_gym,
)
