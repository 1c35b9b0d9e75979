"""Many LoRA adapters on one base model: the training role of the Tinker service
(``serving/tinker``). A plain class, usable without Ray: the service runs one per base model as a
Ray actor, and tests drive it in-process.

Each tenant (one training client of the API) owns one peft adapter (its rank, its targets, its seed),
one AdamW state and one step count; the base weights are frozen and shared. ``forward_backward``
makes the tenant's adapter the active one, so its gradients land on its own factors only, and
they accumulate there until that tenant's ``optim_step`` (the API's contract: several
``forward_backward`` calls may precede a step). Another tenant's calls in between touch none of
it, which is why a tenant's weights after N steps are those of the same tenant trained alone
(``tests/unit/test_lora_tenants.py``).

A saved state is a peft adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)
that transformers (with peft) and vLLM load as they are, with the optimizer state in an
``optimizer/`` subfolder (safetensors plus a JSON of the step counts).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from learners.objectives.tinker_losses import LOSSES, check_inputs

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LORA_ALPHA = 32  # Tinker's LoRA scale convention (alpha 32 whatever the rank)


@dataclass
class AdapterSpec:
    """One tenant's adapter, as ``create_model``'s ``lora_config`` gives it."""

    rank: int = 32
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def targets(self) -> list[str]:
        names = list(ATTN if self.train_attn else ()) + list(MLP if self.train_mlp else ())
        if self.train_unembed:
            names.append("lm_head")
        if not names:
            raise ValueError("a LoRA adapter needs at least one of train_attn, train_mlp, train_unembed")
        return names


@dataclass
class Datum:
    """One ``forward_backward`` datum: the model input's tokens and its loss inputs (length N)."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor]


@dataclass
class AdamStep:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class LoraTenants:
    def __init__(self, base_path: str, dtype: str = "float32", max_adapters: int = 8, max_rank: int = 64) -> None:
        from transformers import AutoModelForCausalLM

        self.base_path, self.max_adapters, self.max_rank = base_path, max_adapters, max_rank
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype))
        base.requires_grad_(False)
        base.eval()  # no dropout: a datum's loss is a function of the weights alone
        self.model: Any = base  # a PeftModel once the first adapter exists
        self.vocab = int(base.get_output_embeddings().weight.shape[0])
        self.tenants: dict[str, dict[str, Any]] = {}
        self._names = 0

    # ---- adapters -------------------------------------------------------------------------
    def create(self, model_id: str, spec: AdapterSpec) -> dict[str, Any]:
        if model_id in self.tenants:
            raise ValueError(f"model {model_id!r} exists already")
        if len(self.tenants) >= self.max_adapters:
            raise ValueError(f"this service holds at most {self.max_adapters} adapters per base model")
        if not 1 <= spec.rank <= self.max_rank:
            raise ValueError(f"LoRA rank {spec.rank} is outside 1..{self.max_rank}")
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=spec.targets(), bias="none"
        )
        self._names += 1
        name = f"t{self._names}"
        # The adapter's random init depends on its seed alone, never on the tenants made before it.
        with torch.random.fork_rng():
            torch.manual_seed(spec.seed if spec.seed is not None else self._names)
            if hasattr(self.model, "add_adapter") and hasattr(self.model, "peft_config"):
                self.model.add_adapter(name, config)
            else:
                self.model = get_peft_model(self.model, config, adapter_name=name)
        params = [p for n, p in self.model.named_parameters() if f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        self.tenants[model_id] = {"name": name, "spec": spec, "params": params, "optim": None, "steps": 0}
        return {"model_id": model_id, "lora_rank": spec.rank, "trainable": sum(p.numel() for p in params)}

    def remove(self, model_id: str) -> None:
        tenant = self._tenant(model_id)
        self.model.delete_adapter(tenant["name"])
        del self.tenants[model_id]

    def _tenant(self, model_id: str) -> dict[str, Any]:
        if model_id not in self.tenants:
            raise ValueError(f"unknown model_id {model_id!r}")
        return self.tenants[model_id]

    def _activate(self, tenant: dict[str, Any]) -> None:
        self.model.base_model.set_adapter(tenant["name"])
        # set_adapter marks the active adapter trainable; the others must stay frozen for a
        # backward pass to leave their gradients alone.
        for other in self.tenants.values():
            for p in other["params"]:
                p.requires_grad_(other is tenant)

    # ---- training -------------------------------------------------------------------------
    def forward_backward(
        self, model_id: str, data: list[Datum], loss_fn: str, config: dict[str, float], forward_only: bool = False
    ) -> dict[str, Any]:
        """Per-datum target log-probs and ``loss:sum``; gradients accumulate unless ``forward_only``."""
        tenant = self._tenant(model_id)
        if not data:
            raise ValueError("forward_backward needs at least one datum")
        for i, d in enumerate(data):
            self._check_datum(i, d, loss_fn)
        self._activate(tenant)
        with torch.set_grad_enabled(not forward_only):
            logprobs = self._target_logprobs(data)
            losses = [LOSSES[loss_fn](lp, d.inputs, config) for lp, d in zip(logprobs, data)]
            total = torch.stack(losses).sum()
        if not bool(torch.isfinite(total)):
            raise ValueError(f"the loss is not finite ({float(total)}); no gradient was kept")
        if not forward_only:
            total.backward()
        return {
            "logprobs": [lp.detach().float().numpy() for lp in logprobs],
            "metrics": {"loss:sum": float(total.detach())},
        }

    def _check_datum(self, i: int, d: Datum, loss_fn: str) -> None:
        if not d.tokens:
            raise ValueError(f"datum {i}: the model input is empty")
        if min(d.tokens) < 0 or max(d.tokens) >= self.vocab:
            raise ValueError(f"datum {i}: a token is outside the vocabulary (0..{self.vocab - 1})")
        try:
            check_inputs(loss_fn, d.inputs, len(d.tokens))
        except ValueError as e:
            raise ValueError(f"datum {i}: {e}") from None
        target = d.inputs["target_tokens"]
        if target.numel() and (int(target.min()) < 0 or int(target.max()) >= self.vocab):
            raise ValueError(f"datum {i}: a target token is outside the vocabulary (0..{self.vocab - 1})")

    def _target_logprobs(self, data: list[Datum]) -> list[torch.Tensor]:
        """log p(target) at each position of each datum, one right-padded batch forward."""
        longest = max(len(d.tokens) for d in data)
        ids = torch.zeros(len(data), longest, dtype=torch.long)
        attn = torch.zeros(len(data), longest, dtype=torch.long)
        for i, d in enumerate(data):
            ids[i, : len(d.tokens)] = torch.tensor(d.tokens)
            attn[i, : len(d.tokens)] = 1
        logits = self.model(input_ids=ids, attention_mask=attn).logits.float()
        out = []
        for i, d in enumerate(data):
            logp = torch.log_softmax(logits[i, : len(d.tokens)], dim=-1)
            target = d.inputs["target_tokens"].long()
            picked = logp.gather(-1, target if target.dim() == 2 else target[:, None])
            out.append(picked if target.dim() == 2 else picked[:, 0])
        return out

    def optim_step(self, model_id: str, adam: AdamStep) -> dict[str, float]:
        tenant = self._tenant(model_id)
        params = tenant["params"]
        if tenant["optim"] is None:
            tenant["optim"] = torch.optim.AdamW(params, lr=adam.learning_rate)
        group = tenant["optim"].param_groups[0]
        group.update(
            lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
        )
        grads = [p.grad for p in params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        if not math.isfinite(norm):
            tenant["optim"].zero_grad(set_to_none=True)
            raise ValueError("the accumulated gradient is not finite; it was dropped and no step was taken")
        if adam.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm)
        tenant["optim"].step()
        tenant["optim"].zero_grad(set_to_none=True)
        tenant["steps"] += 1
        return {"grad_norm:mean": norm, "step:max": float(tenant["steps"])}

    # ---- state ----------------------------------------------------------------------------
    def save(self, model_id: str, folder: str, optimizer: bool = True) -> str:
        """The tenant's adapter (and optimizer) as a peft adapter folder at ``folder``."""
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        tenant = self._tenant(model_id)
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        weights = get_peft_model_state_dict(self.model, adapter_name=tenant["name"])
        save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(out / "adapter_model.safetensors"))
        config = self.model.peft_config[tenant["name"]].to_dict()
        config.update(base_model_name_or_path=self.base_path, target_modules=sorted(config["target_modules"]))
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
        state = {"steps": tenant["steps"], "rank": tenant["spec"].rank, "targets": tenant["spec"].targets()}
        if optimizer and tenant["optim"] is not None:
            state["optimizer"] = _save_optimizer(tenant["optim"], out / "optimizer")
        (out / "optimizer").mkdir(exist_ok=True)
        (out / "optimizer" / "tenant_state.json").write_text(json.dumps(state, indent=2))
        return str(out)

    def load(self, model_id: str, folder: str, optimizer: bool = True) -> dict[str, Any]:
        """A new tenant ``model_id`` from a folder ``save`` wrote (its optimizer too if asked)."""
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        src = Path(folder)
        if not (src / "adapter_model.safetensors").is_file():
            raise ValueError(f"no saved adapter at {folder}")
        config = json.loads((src / "adapter_config.json").read_text())
        state = json.loads((src / "optimizer" / "tenant_state.json").read_text())
        targets = set(config["target_modules"])
        spec = AdapterSpec(
            rank=int(config["r"]),
            train_attn=bool(targets & set(ATTN)),
            train_mlp=bool(targets & set(MLP)),
            train_unembed="lm_head" in targets,
        )
        info = self.create(model_id, spec)
        tenant = self.tenants[model_id]
        set_peft_model_state_dict(
            self.model, load_file(str(src / "adapter_model.safetensors")), adapter_name=tenant["name"]
        )
        if optimizer and "optimizer" in state:
            tenant["optim"] = torch.optim.AdamW(tenant["params"], lr=1e-4)
            _load_optimizer(tenant["optim"], src / "optimizer", state["optimizer"])
            tenant["steps"] = int(state["steps"])
        return info

    def adapter_weights(self, model_id: str) -> dict[str, torch.Tensor]:
        from peft.utils import get_peft_model_state_dict

        name = self._tenant(model_id)["name"]
        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model, adapter_name=name).items()}


def _save_optimizer(optim: torch.optim.Optimizer, folder: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors, steps = {}, {}
    for i, (p, s) in enumerate((p, optim.state[p]) for p in optim.param_groups[0]["params"]):
        if not s:
            continue
        tensors[f"{i}.exp_avg"], tensors[f"{i}.exp_avg_sq"] = s["exp_avg"].contiguous(), s["exp_avg_sq"].contiguous()
        steps[str(i)] = float(s["step"])
    save_file(tensors, str(folder / "optimizer.safetensors"))
    group = {k: v for k, v in optim.param_groups[0].items() if k != "params"}
    return {"steps": steps, "group": json.loads(json.dumps(group, default=list))}


def _load_optimizer(optim: torch.optim.Optimizer, folder: Path, saved: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "optimizer.safetensors"))
    params = optim.param_groups[0]["params"]
    for key, step in saved["steps"].items():
        p = params[int(key)]
        optim.state[p] = {
            "step": torch.tensor(step),
            "exp_avg": tensors[f"{key}.exp_avg"].clone(),
            "exp_avg_sq": tensors[f"{key}.exp_avg_sq"].clone(),
        }
    group = saved["group"]
    optim.param_groups[0].update(
        lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"], weight_decay=group["weight_decay"]
    )
