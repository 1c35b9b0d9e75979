"""Reference policy: a frozen copy of the initial policy that scores sequences.

Its log-probs anchor the KL penalty. Plain class; ``cluster/`` wraps it in a Ray actor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from learners.experience import Experience
from learners.training.modeling import sequence_logprobs


@dataclass
class ReferenceConfig:
    """What the reference needs, and nothing else."""

    # The frozen policy: a local transformers folder (safetensors).
    model_path: str
    # bf16 weights and autocast (halves memory; log-probs within ~1e-2 of fp32); "auto": where
    # the device computes bf16 natively (learners/training/precision.py).
    bf16: bool | str = False
    # Sequences per forward pass, and positions per chunk of vocabulary-sized logits.
    micro_batch_size: int = 8
    chunk: int = 1024
    # Sampling temperature of the generators (log-probs of logits / temperature).
    temperature: float = 1.0
    # Torch threads (0: leave as is).
    threads: int = 0
    trust_remote_code: bool = False
    # A prompt's samples run the prompt once.
    shared_prefix: bool = True
    # Torch device of the model ("cpu", "cuda"); records arrive and leave on the CPU.
    device: str = "cpu"
    # A mixture of experts routes each token by the experts the generator recorded
    # (``Experience.routes``; train.routing_replay=rollout), as the learner's passes do.
    routing_replay: bool = False


class Reference:
    def __init__(
        self,
        model_path: str,
        *,
        bf16: bool | str = False,
        micro_batch_size: int = 8,
        chunk: int = 1024,
        temperature: float = 1.0,
        threads: int = 0,
        trust_remote_code: bool = False,
        shared_prefix: bool = True,
        device: str = "cpu",
        routing_replay: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        # A frozen model needs no fp32 master copy: bf16 weights halve memory and skip autocast's
        # per-call weight casts.
        from learners.training.attention import register
        from learners.training.precision import resolve_bf16

        bf16 = resolve_bf16(bf16, device)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path,
            dtype=torch.bfloat16 if bf16 else torch.float32,
            trust_remote_code=trust_remote_code,
            attn_implementation=register(),
        )
        self.device = torch.device(device)
        self.model.eval().requires_grad_(False).to(self.device)
        self.bf16 = bf16
        self.micro_batch_size = micro_batch_size
        self.chunk = chunk
        self.temperature = temperature
        self.shared_prefix = shared_prefix
        self.routing_replay = routing_replay

    @classmethod
    def from_config(cls, cfg: ReferenceConfig) -> "Reference":
        return cls(
            cfg.model_path,
            bf16=cfg.bf16,
            micro_batch_size=cfg.micro_batch_size,
            chunk=cfg.chunk,
            temperature=cfg.temperature,
            threads=cfg.threads,
            trust_remote_code=cfg.trust_remote_code,
            shared_prefix=cfg.shared_prefix,
            device=cfg.device,
            routing_replay=cfg.routing_replay,
        )

    def logprobs(self, exp: Experience) -> torch.Tensor:
        """(B, L) reference log-probs at the response positions of ``exp``, on ``exp``'s device."""
        on = exp.to(self.device)
        return sequence_logprobs(
            self.model,
            on.input_ids,
            on.attention_mask,
            on.response_mask,
            temperature=self.temperature,
            micro_batch_size=self.micro_batch_size,
            chunk=self.chunk,
            bf16=self.bf16,
            group_ids=on.group_ids if self.shared_prefix else None,
            routes=on.routes if self.routing_replay else None,
        ).to(exp.input_ids.device)

    def annotate(self, exp: Experience) -> tuple[Experience, float]:
        """Returns the record with ``ref_logprobs`` filled, and the seconds it took."""
        t0 = time.perf_counter()
        out = exp.replace(ref_logprobs=self.logprobs(exp)).validate()
        return out, time.perf_counter() - t0
