"""The scorer server: ``POST /v1/score`` over any scorer (rule function, reward model, LLM judge),
as a Ray Serve application; a training run can use it as its remote scorer
(``reward.function=remote``, ``actors/rewards/remote.py`` speaks its protocol).

    request   {"prompts": [str], "completions": [str], "meta": [{...}] (optional)}
    reply     {"scores": [float | null], "model": str, "skipped": {reason: count}}

A sample the scorer could not score gets ``null``, never a made-up number. Build it with
``build_scorer_app(args)`` (``serve run serving.scorer:build_scorer_app function=...``, a Serve
config file, or ``rayrlhf serve scorer``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from serving.common import Guard, GuardSettings, Limits, add_error_handlers, api_key_from_env, configure_guard


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: list[str] = Field(description="The prompt of each sample.")
    completions: list[str] = Field(description="The response of each sample, aligned with prompts.")
    meta: list[dict[str, Any]] | None = Field(
        None, description="Per-sample metadata a rule function reads (e.g. the answer)."
    )


def check_items(req: ScoreRequest, limits: Limits) -> str | None:
    """Why a scoring request is refused (None: it is fine)."""
    n = len(req.completions)
    if len(req.prompts) != n:
        return f"prompts ({len(req.prompts)}) and completions ({n}) must have the same length"
    if req.meta is not None and len(req.meta) != n:
        return f"meta ({len(req.meta)}) must have one entry per completion ({n})"
    if n > limits.max_items:
        return f"{n} items are over the limit of {limits.max_items} per request"
    return None


app = FastAPI(title="rayrlhf scorer")
add_error_handlers(app)
guard = GuardSettings()
GUARD = "serving.scorer:guard"
app.add_middleware(Guard, settings=GUARD)


class ScorerBackend:
    """One scorer (``actors/scorer.build_scorer``) called through a deployment handle (``score``):
    how the policy server's best-of-n ranks its samples, and the core of ``ScorerServer``."""

    def __init__(self, spec: Any, name: str = "") -> None:
        from actors.rewards.scorer_factory import build_scorer

        self.scorer = build_scorer(spec)
        self.name = name or spec.function
        self._lock = threading.Lock()  # a scorer (a model, an engine) serves one batch at a time

    def _score_now(self, prompts: list[str], completions: list[str], meta: list[dict]) -> dict[str, Any]:
        with self._lock:
            values, skipped = self.scorer.score_texts(prompts, completions, meta)
        return {"scores": values, "model": self.name, "skipped": {k: v for k, v in skipped.items() if v}}

    async def score(self, prompts: list[str], completions: list[str], meta: list[dict] | None = None) -> dict[str, Any]:
        meta = meta if meta is not None else [{} for _ in completions]
        return await asyncio.to_thread(self._score_now, prompts, completions, meta)


@serve.deployment(name="Scorer", ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class ScorerServer(ScorerBackend):
    """``ScorerBackend`` behind ``/v1/score`` (see module doc)."""

    def __init__(self, spec: Any, limits: Limits | None = None, api_key: str = "", name: str = "") -> None:
        self.limits = limits or Limits()
        configure_guard(GUARD, api_key, self.limits.max_body_bytes)
        super().__init__(spec, name)

    @app.post("/v1/score")
    async def score_http(self, req: ScoreRequest) -> JSONResponse:
        problem = check_items(req, self.limits)
        if problem:
            return JSONResponse(
                status_code=400, content={"error": {"message": problem, "type": "invalid_request_error", "code": 400}}
            )
        return JSONResponse(await self.score(req.prompts, req.completions, req.meta))

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "rayrlhf"}]}


def scorer_spec_from_args(args: dict[str, Any]) -> Any:
    """A ``ScorerSpec`` from an app's ``args`` (rule ``function``, or ``reward_model`` / ``llm_judge``
    with ``model``); unknown keys are refused."""
    from actors.rewards.scorer_factory import ScorerSpec

    known = {f for f in ScorerSpec.__dataclass_fields__ if f not in ("judge", "judge_engine", "remote")}
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown scorer settings {sorted(unknown)}; known: {sorted(known)}")
    spec = ScorerSpec(**{**args, "on_error": "skip"})  # a server answers null for a failed sample
    if spec.function == "llm_judge":
        from actors.rollout.generator import GeneratorConfig
        from actors.rewards.judge import JudgeConfig

        spec.judge = JudgeConfig()
        spec.judge_engine = GeneratorConfig(
            model_path=spec.model,
            max_prompt_tokens=spec.judge.max_prompt_tokens,
            max_new_tokens=spec.judge.max_new_tokens,
            temperature=spec.judge.temperature,
            max_model_len=spec.judge.max_prompt_tokens + spec.judge.max_new_tokens,
        )
    if spec.function == "remote":
        raise ValueError("a scorer server does not forward to another remote scorer")
    return spec


def build_scorer_app(args: dict[str, Any]) -> Any:
    """The scorer application. ``args``: ``scorer`` (ScorerSpec fields: function, model, kwargs,
    batch_size, ...), ``api_key_env`` (default RAYRLHF_API_KEY), ``limits`` (Limits fields),
    ``num_replicas``, ``num_cpus``."""
    args = dict(args)
    spec = scorer_spec_from_args(dict(args.pop("scorer", {"function": "reasoning_gym"})))
    limits = Limits(**args.pop("limits", {}))
    api_key = api_key_from_env(args.pop("api_key_env", "RAYRLHF_API_KEY"))
    options = {
        "num_replicas": int(args.pop("num_replicas", 1)),
        "ray_actor_options": {"num_cpus": float(args.pop("num_cpus", 0))},
    }
    if args:
        raise ValueError(f"unknown scorer app settings {sorted(args)}")
    return ScorerServer.options(**options).bind(spec, limits, api_key)
