"""Rollout routing replay (R3) and router health for mixture-of-experts policies.

An MoE layer's router picks each token's top-k experts. The inference engine and the trainer
compute the router's logits with different kernels, so near-ties fall differently: the learner's
log-probs of a sampled token then come from other experts than the ones that sampled it, and the
importance ratios drift (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning
Training and Inference Routers", the R3 method). Replay makes the learner use the experts the
engine recorded for each token.

Convention (the paper's, and verl's / Megatron's): the experts are replayed, the gate weights are
not. The learner's router still computes its logits ``z``; the token's weights are its own softmax
gathered at the replayed experts ``I`` and, where the model renormalises its top-k
(``norm_topk_prob``), renormalised over them:

    w_i = softmax(z)_i / sum_{j in I} softmax(z)_j,    i in I            (R3, eq. 4)

so the router keeps its gradient (through ``z``) while the expert choice is the engine's. Replaying
the engine's weights as well would cut the router out of training.

``routes`` everywhere: int (..., layers, k) expert ids, -1 where none was recorded (padding, a
prompt token the engine served from its prefix cache, a record from before routes existed); such
tokens fall back to the learner's own routing and are counted. ``OBSERVED`` (-2) marks a token the
learner routes by design (a multi-turn row's observations): its own routing, not counted.

Works on the routers of transformers 5 (``Qwen3MoeTopKRouter`` and the same ``*TopKRouter``
convention: ``forward(hidden) -> (logits, weights, indices)``, attributes ``top_k``,
``num_experts``, ``norm_topk_prob``). Pure torch; no Ray, no vLLM.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# Routed by the learner by design (kept equal to ``actors/rollout/records.py:OBSERVED``).
OBSERVED = -2


def replayed_topk(
    router_logits: torch.Tensor, routes: torch.Tensor | None, top_k: int, normalise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights (N, k) float32, experts (N, k) int64, replayed (N,) bool, own (N, k) int64).

    ``router_logits``: (N, E). ``routes``: (N, k) recorded experts, -1 where none (a row with any
    -1 falls back to its own top-k). ``own``: the top-k the router itself picks (for the
    mismatch metric). Weights follow R3, eq. 4 (module docstring); with ``routes`` None or all
    missing this is exactly the router's own top-k routing."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    own = torch.topk(probs, top_k, dim=-1).indices
    if routes is None:
        replayed = torch.zeros(probs.shape[0], dtype=torch.bool, device=probs.device)
        experts = own
    else:
        routes = routes.to(device=probs.device, dtype=torch.long)
        replayed = (routes >= 0).all(-1)
        experts = torch.where(replayed[:, None], routes, own)
    weights = probs.gather(-1, experts)
    if normalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts, replayed, own


def route_mismatch(own: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """(N,) bool: the two top-k sets differ (the order within a set does not matter)."""
    return (own.sort(-1).values != recorded.to(own.dtype).sort(-1).values).any(-1)


def is_router(module: nn.Module) -> bool:
    """A transformers top-k router: ``forward(hidden) -> (logits, weights, indices)``."""
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k") and hasattr(module, "weight")


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (a dense model has none)."""
    return [m for m in model.modules() if is_router(m)]


@dataclass
class RouterStats:
    """Router health over the tokens of one or more passes, per layer (sums; ``metrics`` divides).

    ``load``: (layers, experts) top-k assignments; ``prob``: (layers, experts) router probability
    mass (for the load-balancing loss); ``tokens``: counted tokens per layer; ``compared``: tokens
    with a recorded route; ``mismatched``: of those, the ones whose own top-k differs;
    ``fallback``: tokens that should have had a route and had none."""

    load: torch.Tensor | None = None
    prob: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    compared: int = 0
    mismatched: int = 0
    fallback: int = 0
    aux_losses: list = field(default_factory=list)

    def add(self, layer: int, layers: int, probs, experts, counted, replayed, mismatched, fallback) -> None:
        e = probs.shape[-1]
        if self.load is None:
            self.load = torch.zeros(layers, e)
            self.prob = torch.zeros(layers, e)
            self.tokens = torch.zeros(layers)
        ex = experts[counted].reshape(-1).cpu()
        self.load[layer] += torch.bincount(ex, minlength=e).float()
        self.prob[layer] += probs[counted].detach().float().sum(0).cpu()
        self.tokens[layer] += float(counted.sum())
        self.compared += int((replayed & counted).sum())
        self.mismatched += int((mismatched & replayed & counted).sum())
        self.fallback += int(fallback.sum())

    def summed(self, all_reduce_sum, layers: int, experts: int) -> "RouterStats":
        """These counts summed over ranks by ``all_reduce_sum`` (every rank calls it, those
        without a counted pass too, with zeros): the health of the whole step's batch."""
        load = self.load if self.load is not None else torch.zeros(layers, experts)
        prob = self.prob if self.prob is not None else torch.zeros(layers, experts)
        tokens = self.tokens if self.tokens is not None else torch.zeros(layers)
        counts = torch.tensor([self.compared, self.mismatched, self.fallback], dtype=torch.float64)
        flat = all_reduce_sum(torch.cat([load.reshape(-1), prob.reshape(-1), tokens, counts.float()]).double())
        n = layers * experts
        out = RouterStats(
            load=flat[:n].reshape(layers, experts).float(),
            prob=flat[n : 2 * n].reshape(layers, experts).float(),
            tokens=flat[2 * n : 2 * n + layers].float(),
        )
        out.compared, out.mismatched, out.fallback = (int(round(float(v))) for v in flat[2 * n + layers :])
        if not float(out.tokens.sum()):
            out.load = out.prob = out.tokens = None
        return out

    def metrics(self, prefix: str = "router/") -> dict[str, float]:
        """Per layer: the largest and smallest expert's share of the top-k assignments and the
        load's normalised entropy (1: uniform); overall: the mismatch and fallback fractions and
        the Switch load-balancing loss (``load_balancing_loss``, averaged over the layers)."""
        if self.load is None:
            return {}
        out: dict[str, float] = {}
        share = self.load / self.load.sum(-1, keepdim=True).clamp_min(1)
        e = share.shape[-1]
        for layer in range(share.shape[0]):
            s = share[layer]
            ent = float(-(s[s > 0] * s[s > 0].log()).sum() / torch.log(torch.tensor(float(e))))
            out[f"{prefix}layer{layer}/load_max"] = float(s.max())
            out[f"{prefix}layer{layer}/load_min"] = float(s.min())
            out[f"{prefix}layer{layer}/load_entropy"] = ent
        frac = self.load / self.tokens[:, None].clamp_min(1)
        mean_prob = self.prob / self.tokens[:, None].clamp_min(1)
        out[f"{prefix}aux_loss"] = float((e * (frac * mean_prob).sum(-1)).mean())
        out[f"{prefix}replayed_tokens"] = float(self.compared)
        out[f"{prefix}route_mismatch"] = self.mismatched / self.compared if self.compared else 0.0
        out[f"{prefix}fallback_tokens"] = float(self.fallback)
        return out


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss for one layer (Fedus et al. 2021, eqs. 4-6) as
    transformers computes it (``load_balancing_loss_func``, which ``router_aux_loss_coef``
    weighs): ``E * sum_e f_e * P_e`` with ``f_e`` the share of the ``counted`` tokens routed to
    expert ``e`` (summing to k over the experts) and ``P_e`` its mean router probability;
    differentiable in ``probs``. ``k`` when perfectly balanced."""
    e = probs.shape[-1]
    n = counted.sum().clamp_min(1)
    assigned = F.one_hot(experts[counted], e).sum(1).float().sum(0) / n
    return e * (assigned * probs[counted].sum(0) / n).sum()


@contextlib.contextmanager
def replay_routes(
    model: nn.Module,
    routes: torch.Tensor | None,
    counted: torch.Tensor,
    stats: RouterStats | None = None,
    *,
    needed: torch.Tensor | None = None,
    replay: bool = True,
    aux: bool = False,
):
    """Within the block, every router of ``model`` routes the rows of one decoder pass over
    (B, L) tokens by ``routes`` (B, L, layers, k); ``replay`` False (or ``routes`` None): by its
    own top-k, the recorded routes only measured against it (``RouterStats``).

    ``counted`` (B, L) bool: the real tokens (health metrics); ``needed`` (B, L) bool: tokens whose
    route decides a log-prob (a missing one is a counted fallback); default ``counted``. ``aux``:
    each layer's load-balancing loss (with its graph) is appended to ``stats.aux_losses``.
    The decoder must run the rows as they are laid out (no shared-prefix packing) and each
    router once per pass (no activation checkpointing, which re-runs it after the block)."""
    found = routers(model)
    if routes is not None and routes.shape[2] != len(found):
        raise ValueError(f"routes hold {routes.shape[2]} MoE layers, the model has {len(found)} routers")
    flat_counted = counted.reshape(-1)
    flat_needed = (counted if needed is None else needed).reshape(-1)
    for layer, router in enumerate(found):
        flat = None if routes is None else routes[:, :, layer].reshape(-1, routes.shape[-1])
        router.forward = types.MethodType(
            _replaying_forward(layer, len(found), flat, flat_counted, flat_needed, stats, replay, aux), router
        )
    try:
        yield found
    finally:
        for router in found:
            router.__dict__.pop("forward", None)


def _replaying_forward(layer, layers, flat_routes, counted, needed, stats, replay, aux):
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.weight.shape[-1])
        logits = F.linear(hidden_states, self.weight)
        if flat_routes is not None and flat_routes.shape[0] != logits.shape[0]:
            raise ValueError(f"routes cover {flat_routes.shape[0]} tokens, the pass routes {logits.shape[0]}")
        normalise = bool(getattr(self, "norm_topk_prob", True))
        weights, experts, replayed, own = replayed_topk(logits, flat_routes if replay else None, self.top_k, normalise)
        if stats is not None:
            c, nd = counted.to(logits.device), needed.to(logits.device)
            if flat_routes is None:
                recorded = torch.zeros_like(c)
                mismatched = recorded
            else:
                rec = flat_routes.to(logits.device).long()
                recorded = (rec >= 0).all(-1)
                mismatched = route_mismatch(own, rec.clamp_min(0))
            probs = torch.softmax(logits, -1, dtype=torch.float32)
            stats.add(layer, layers, probs, experts, c, recorded, mismatched, nd & ~recorded)
            if aux:
                stats.aux_losses.append(load_balancing_loss(probs, experts, c))
        return logits, weights.to(logits.dtype), experts

    return forward
