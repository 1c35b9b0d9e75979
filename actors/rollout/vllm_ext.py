"""vLLM worker extension: in-place weight reload on the engine's worker.

Loaded by vLLM through ``LLM(worker_extension_cls="actors.rollout.vllm_ext.WeightReloadExtension")``
and reached with ``llm.collective_rpc("rayrlhf_load_weights", args=...)``. It runs inside the
vLLM worker, so it may import vLLM freely; nothing else in ``actors`` imports it.
"""

from __future__ import annotations

from typing import Iterable

import torch


class WeightReloadExtension:
    def rayrlhf_load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Loads checkpoint-format tensors (transformers names) in place; returns how many.

        ``model.load_weights`` fails on the CPU backend because Linear weights are repacked
        after loading; ``reload_weights`` re-runs the loader and the repacking.
        """
        count = [0]

        def counted():  # streamed: merged LoRA weights are made one at a time (learners/training/lora_sync.py)
            for item in named_tensors:
                count[0] += 1
                yield item

        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        tied = bool(getattr(model.config, "tie_word_embeddings", False)) if hasattr(model, "config") else False
        if not tied:
            tied = getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False)
        if tied and lm_head is not None and embed is not None:
            # reload_weights leaves a tied lm_head on its old tensor: re-tie it and re-pack.
            lm_head.weight = embed.weight
            quant = getattr(lm_head, "quant_method", None)
            if quant is not None and hasattr(quant, "process_weights_after_loading"):
                quant.process_weights_after_loading(lm_head)
        return count[0]


class RewindSafeGenerator(torch.Generator):
    """A per-request sampling generator whose offset calls are no-ops on the CPU. vLLM rewinds a
    request's generator by its Philox offset when it throws away a sample (a prompt prefilled in
    chunks samples before its last chunk); a CPU generator has no offset and raised ("CPU
    Generator does not use offset"), which ended every seeded request batch large enough to be
    chunked. On the CPU the thrown-away sample's draws are simply consumed."""

    def get_offset(self) -> int:
        return 0 if self.device.type == "cpu" else super().get_offset()

    def set_offset(self, offset: int) -> "RewindSafeGenerator":
        return self if self.device.type == "cpu" else super().set_offset(offset)


def make_seeded_requests_safe_on_cpu() -> None:
    """Has vLLM's model runner build its per-request generators as ``RewindSafeGenerator``: its
    module sees a copy of ``torch`` whose ``Generator`` is that class (everything else is torch's
    own). Idempotent; call before the engine starts."""
    import types

    from vllm.v1.worker import gpu_model_runner

    if getattr(gpu_model_runner.torch, "Generator", None) is RewindSafeGenerator:
        return
    proxy = types.ModuleType("torch")
    proxy.__dict__.update(torch.__dict__)
    proxy.Generator = RewindSafeGenerator
    gpu_model_runner.torch = proxy
