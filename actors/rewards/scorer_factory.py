"""Which scorer a role builds: ``ScorerSpec`` (the scorer role's own settings, typed) and
``build_scorer``. It imports every scorer kind; the kinds import only ``actors/rewards/scorer.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.rollout.generator import GeneratorConfig
from actors.rewards.judge import JudgeConfig, JudgeScorer
from actors.rewards.remote import RemoteScorer, RemoteSettings
from actors.rewards.routing import RoutedScorer
from actors.rewards.reward_model import RewardModelScorer
from actors.rewards.scorer import Scorer, TextScorer

# reward.function values that are not rule functions.
SCORER_KINDS = ("reward_model", "llm_judge", "remote")


@dataclass
class ScorerSpec:
    """Which scorer to build and its own settings (the scorer role, the scorer server and scripts
    get this, not the run's config; ``cluster/role_settings.scorer_spec`` picks it from one)."""

    # A rule function (built-in or 'module:function'), 'reward_model', 'llm_judge' or 'remote'.
    function: str = "reasoning_gym"
    # Extra keyword arguments of a rule function.
    kwargs: dict = field(default_factory=dict)
    # 'skip' (drop and count a sample without a reward) or 'raise'.
    on_error: str = "skip"
    # Reward-model folder (reward_model) or judge model folder (llm_judge).
    model: str = ""
    # Reward model: sequences per forward pass, longest sequence, system prompt of the chat
    # template (the one its pairs were encoded with), torch threads (0: leave as is).
    batch_size: int = 16
    max_tokens: int = 1024
    system_prompt: str = ""
    threads: int = 0
    # llm_judge: the judge's settings and its engine's.
    judge: JudgeConfig | None = None
    judge_engine: GeneratorConfig | None = None
    # remote: the endpoint's settings.
    remote: RemoteSettings | None = None
    # Weighted rule functions per source (None: every row), routed on the row's ``source_key``
    # (``actors/rewards/routing.py``); set, they replace ``function``.
    routes: dict[str | None, list[tuple[str, float, dict]]] | None = None
    source_key: str = "data_source"


def build_scorer(spec: ScorerSpec) -> TextScorer:
    """The scorer a spec names (heavy models load here, inside whichever process calls it)."""
    if spec.function == "reward_model":
        return RewardModelScorer(
            spec.model,
            batch_size=spec.batch_size,
            max_tokens=spec.max_tokens,
            system_prompt=spec.system_prompt,
            on_error=spec.on_error,
            threads=spec.threads,
        )
    if spec.function == "llm_judge":
        if spec.judge is None or spec.judge_engine is None:
            raise ValueError("an llm_judge scorer needs its judge settings and a judge model (engine) config")
        return JudgeScorer(spec.judge, spec.judge_engine, on_error=spec.on_error)
    if spec.function == "remote":
        if spec.remote is None:
            raise ValueError("a remote scorer needs its settings (url, ...)")
        return RemoteScorer(spec.remote, on_error=spec.on_error)
    if spec.routes:
        return RoutedScorer(spec.routes, spec.source_key, spec.on_error)
    return Scorer(spec.function, spec.kwargs, spec.on_error)
