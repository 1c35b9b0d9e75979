"""vLLM worker extension: in-place weight reload on the engine's worker.

Loaded by vLLM through ``LLM(worker_extension_cls="actors.vllm_ext.WeightReloadExtension")``
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
        named = list(named_tensors)
        self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
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
        return len(named)
