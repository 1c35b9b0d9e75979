"""A vLLM engine that samples from the base model or from any saved LoRA adapter folder (vLLM's
multi-LoRA: adapters load on first use and are evicted least-recently-used past ``max_loras``):
the sampling role of the Tinker service (``serving/tinker``). A plain class, usable without Ray.

Tokens in, tokens out: a request is a prompt's token ids, and each sample comes back with the
log-prob of every sampled token under the sampling distribution's model (the adapter's weights,
before temperature), and the prompt's own log-probs when asked (``compute_logprobs``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass
class SamplerConfig:
    base_path: str
    dtype: str = "float32"
    max_model_len: int = 1024
    max_loras: int = 4
    max_lora_rank: int = 64
    kv_cache_gib: float = 1.0
    max_tokens: int = 512  # the most new tokens a request may ask for


@dataclass
class SampleParams:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: Any = None  # None: end of sequence; [] no stop at all; [str] or [int]


class AdapterSampler:
    def __init__(self, cfg: SamplerConfig) -> None:
        from actors.rollout.generator import configure_vllm_env

        configure_vllm_env(cfg.kv_cache_gib)
        from vllm import LLM

        self.cfg = cfg
        self.llm = LLM(
            cfg.base_path,
            enable_lora=True,
            max_loras=cfg.max_loras,
            max_lora_rank=cfg.max_lora_rank,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            enforce_eager=True,
            trust_remote_code=False,
        )
        self._ids: dict[tuple[str, float], int] = {}

    def _lora(self, adapter: str | None) -> Any:
        if not adapter:
            return None
        from vllm.lora.request import LoRARequest

        weights = os.path.join(adapter, "adapter_model.safetensors")
        if not os.path.isfile(weights):
            raise ValueError(f"no adapter at {adapter}")
        # A folder written again is a new adapter to vLLM (its cache is keyed by the id).
        key = (adapter, os.path.getmtime(weights))
        if key not in self._ids:
            self._ids[key] = len(self._ids) + 1
        return LoRARequest(f"adapter-{self._ids[key]}", self._ids[key], adapter)

    def _params(self, p: SampleParams, n: int, room: int, prompt_logprobs: bool) -> Any:
        from vllm import SamplingParams

        stop = p.stop
        if isinstance(stop, str):
            stop = [stop]
        wanted = p.max_tokens if p.max_tokens is not None else self.cfg.max_tokens
        if wanted < 1 or wanted > self.cfg.max_tokens:
            raise ValueError(f"max_tokens {wanted} is outside 1..{self.cfg.max_tokens}")
        return SamplingParams(
            n=n,
            max_tokens=max(1, min(wanted, room)),
            temperature=p.temperature,
            top_k=p.top_k if p.top_k > 0 else 0,
            top_p=p.top_p,
            seed=p.seed,
            logprobs=0,
            prompt_logprobs=0 if prompt_logprobs else None,
            stop=[s for s in (stop or []) if isinstance(s, str)] or None,
            stop_token_ids=[s for s in (stop or []) if isinstance(s, int)] or None,
            ignore_eos=stop == [],
        )

    def sample(
        self, prompt: list[int], n: int, params: SampleParams, adapter: str | None = None, prompt_logprobs: bool = False
    ) -> dict[str, Any]:
        room = self.cfg.max_model_len - len(prompt)
        if not prompt or room < 1:
            raise ValueError(f"the prompt has {len(prompt)} tokens; this sampler takes 1..{self.cfg.max_model_len - 1}")
        sp = self._params(params, n, room, prompt_logprobs)
        out = self.llm.generate(
            {"prompt_token_ids": list(prompt)}, sp, lora_request=self._lora(adapter), use_tqdm=False
        )[0]
        sequences = [
            {
                "tokens": list(c.token_ids),
                "logprobs": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)],
                "stop_reason": "length" if c.finish_reason == "length" else "stop",
            }
            for c in out.outputs
        ]
        prompt_lp = None
        if prompt_logprobs:
            prompt_lp = [float("nan")] + [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        return {"sequences": sequences, "prompt_logprobs": prompt_lp}
