"""vLLM worker extension: in-place weight reload on the engine's worker.

Loaded by vLLM through ``LLM(worker_extension_cls="actors.rollout.vllm_ext.WeightReloadExtension")``
and reached with ``llm.collective_rpc("rayrlhf_load_weights", args=...)``. It runs inside the
vLLM worker, so it may import vLLM freely; nothing else in ``actors`` imports it.
"""

from __future__ import annotations

from typing import Iterable

import torch


class RouteCaptureExtension:
    """Records, inside the vLLM worker, the experts each MoE layer routed every computed token to
    (rollout routing replay). vLLM's own capture (``enable_return_routed_experts``) needs its
    second model runner, which needs Triton, so on the CPU it cannot run; its routers still call
    ``capture_fn`` with the logical expert ids, and this extension maps each row of a step to its
    request and position through the model runner's ``req_indices`` and ``positions``.

    Routes are kept per engine request id, ``[position, layer, k]`` int16 with -1 where a
    position was not computed (a prefix-cache hit), until ``rayrlhf_take_routes`` hands them
    over (and forgets them)."""

    def rayrlhf_enable_route_capture(self) -> int:
        """Binds the capture to every MoE router of the model; returns the number of MoE layers."""
        model = self.model_runner.get_model()
        layers = [m for m in model.modules() if hasattr(getattr(m, "router", None), "set_capture_fn")]
        self._rayrlhf_routes: dict[str, dict[int, torch.Tensor]] = {}
        self._rayrlhf_moe_layers = len(layers)
        for index, layer in enumerate(layers):
            layer.router.set_capture_fn(lambda ids, index=index: self._rayrlhf_capture(index, ids))
        return len(layers)

    def _rayrlhf_capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        runner = self.model_runner
        n = topk_ids.shape[0]
        positions = runner.positions[:n].cpu()
        req_index = torch.from_numpy(runner.req_indices.np[:n].copy())
        ids = topk_ids.to(torch.int16).cpu()
        for i in torch.unique(req_index).tolist():
            rows = req_index == i
            req_id = runner.input_batch.req_ids[i]
            per_layer = self._rayrlhf_routes.setdefault(req_id, {})
            per_layer.setdefault(layer, []).append((positions[rows], ids[rows]))

    def rayrlhf_take_routes(self, request_ids: list[str]) -> dict[str, torch.Tensor]:
        """The routes of the given requests (external ids: vLLM appends a random suffix to each
        internal id), ``[positions, layers, k]`` int16, -1 where none was recorded."""
        wanted = set(request_ids)
        out = {}
        for internal in [r for r in self._rayrlhf_routes if r.rsplit("-", 1)[0] in wanted]:
            out[internal.rsplit("-", 1)[0]] = _assemble(self._rayrlhf_routes.pop(internal), self._rayrlhf_moe_layers)
        return out

    def rayrlhf_forget_routes(self) -> None:
        self._rayrlhf_routes = {}


def _assemble(per_layer: dict[int, list], layers: int) -> torch.Tensor:
    """One request's recorded (positions, ids) chunks per layer as ``[length, layers, k]``."""
    chunks = [c for layer_chunks in per_layer.values() for c in layer_chunks]
    length = int(max(int(p.max()) for p, _ in chunks)) + 1
    k = chunks[0][1].shape[1]
    routes = torch.full((length, layers, k), -1, dtype=torch.int16)
    for layer, layer_chunks in per_layer.items():
        for positions, ids in layer_chunks:
            routes[positions.long(), layer] = ids
    return routes


class WeightReloadExtension(RouteCaptureExtension):
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
        _repack_cpu_experts(model)
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


def _repack_cpu_experts(model: torch.nn.Module) -> int:
    """On the CPU, vllm 0.32 leaves a mixture-of-experts layer's reloaded expert weights unpacked:
    ``UnquantizedFusedMoEMethod._setup_kernel`` runs the CPU experts' prepacking
    (``fused_experts.process_weights_after_loading``) only when it first builds the kernel, not on
    a weight update, and the CPU kernel then reads plain weights as packed ones (measured: 4 nats
    off on every probe token). Runs that prepacking for each reloaded layer. Returns the number
    of layers repacked; the generator's sync probe checks the result."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    count = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if hasattr(module, "w13_weight") and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(module)
            count += 1
    return count
