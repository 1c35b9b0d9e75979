"""The learner interface every algorithm implements, its registry, and the checkpoint layout.

A learner is plain torch: it runs inside a Ray Train worker (``cluster/roles/learner_group.py``) or in
a test. It is built from a model path, the shared training settings (``train`` section) and its
own section (``ppo``, ...), trains on the *global* batch of each step (taking its own rows of it,
see ``learners/training/distributed.py``), hands out policy weights for the generators, and saves /
restores everything a run needs to continue.

Adding an algorithm: a new ``learners/<name>.py`` with a ``Learner`` subclass, one line in
``LEARNERS`` below (``register_learner`` from a package of your own), its config section and
its recipe (``cluster/recipes/__init__.py``).

Checkpoint layout (``save``): the folder itself is a model folder that ``transformers`` and
``vllm.LLM(model=...)`` load as it is (``config.json``, ``model.safetensors``, tokenizer); vLLM
loads every ``*.safetensors`` file at the top level, so everything else lives in subfolders:
``critic/`` (value head), ``adapter/`` (LoRA, peft format) and ``trainer_state/`` (optimiser,
scheduler, RNG, version, algorithm state; the run's own state is written there by the driver).
"""

from __future__ import annotations

import abc
import contextlib
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from learners.training.distributed import Collective
from learners.experience import Experience, ExperienceError

#: Algorithm name -> "module:Class" of its learner (imported on use: only learners pay for torch models).
LEARNERS: dict[str, str] = {
    "ppo": "learners.ppo:PPOLearner",
    "dpo": "learners.dpo:DPOLearner",
    "sft": "learners.sft:SFTLearner",
    "qlearn": "learners.qlearn:QLearner",
    "reward_model": "learners.reward_model:RewardModelLearner",
}

CRITIC_DIR = "critic"
ADAPTER_DIR = "adapter"
TRAINER_STATE_DIR = "trainer_state"
LEARNER_STATE_FILE = "learner.pt"


class LoRAParams(Protocol):
    """The fields of ``cluster.config.LoRAConfig`` a learner reads."""

    enabled: bool
    r: int
    alpha: float
    dropout: float
    target_modules: list
    # peft target_parameters: fused tensors (a mixture of experts' experts); may be absent.
    target_parameters: list


class TrainParams(Protocol):
    """The fields of ``cluster.config.TrainConfig`` (documented there) every learner reads."""

    optimizer: str
    lr: float
    weight_decay: float
    adam_betas: list
    lr_schedule: str
    warmup_steps: int
    min_lr_ratio: float
    max_grad_norm: float
    epochs: int
    num_minibatches: int
    micro_batch_size: int
    bf16: bool | str  # True, False or "auto" (learners/training/precision.py)
    gradient_checkpointing: bool
    compile: bool
    logprob_chunk: int
    fused_logprobs: bool
    shared_prefix: bool
    sharding: str  # "replicated" or "fsdp" (learners/training/sharding.py)
    cpu_offload: bool  # sharded shards and optimiser state in host memory (learners/training/sharding.py)
    reference: str  # "actor" or "learners": where reference log-probs come from without LoRA
    routing_replay: str  # "none", "record" or "rollout" (learners/training/routing.py)
    router_aux_loss: bool


@dataclass
class LearnerContext:
    """What a learner gets besides its settings: where it starts and where it runs."""

    # Initial policy: a transformers folder (safetensors). With LoRA also the frozen base.
    model_path: str
    # Seeds model initialisation (value head) and minibatch shuffles.
    seed: int = 0
    # Training iterations of the run (learning-rate schedules span them).
    total_steps: int = 1
    # Sampling temperature of the generators: log-probs are computed from logits / temperature.
    temperature: float = 1.0
    # Response length limit of the generators (default normaliser of some loss aggregations).
    max_new_tokens: int = 0
    # LoRA settings, or None for full fine-tuning.
    lora: LoRAParams | None = None
    # Residual dropout of the policy's forward passes in train mode (learners/training/modeling.py).
    dropout: float = 0.0
    # Reductions across data-parallel ranks (single-process by default).
    comm: Collective | None = None
    # Torch device the learner computes on ("cpu", "cuda:0", ...): its model lives there and
    # every batch is moved there on arrival. Ray Train's worker passes the GPU it was given.
    device: str = "cpu"


class Learner(abc.ABC):
    """What every learner provides. ``version`` counts completed updates (the policy version)."""

    #: Name in ``LEARNERS`` and ``run.algorithm``.
    name: ClassVar[str]
    #: Config section holding the algorithm's own settings.
    config_section: ClassVar[str]
    #: Experience fields that must be filled (not None) in every batch.
    required_fields: ClassVar[tuple[str, ...]] = ()

    version: int = 0
    #: Fraction of the policy's parameters that train (1.0, or small with LoRA).
    trainable_fraction: float = 1.0

    @classmethod
    def build(cls, ctx: LearnerContext, train: TrainParams, algo: Any) -> "Learner":
        """The learner from its context, the shared ``train`` settings and its own section."""
        return cls(ctx, train, algo)

    @abc.abstractmethod
    def train_step(self, batch: Experience) -> dict[str, float]:
        """One update on the global batch; returns global scalar metrics (the same on every rank)."""

    def evaluate(self, batch: Experience) -> dict[str, float]:
        """Held-out metrics of the current policy on a batch (no update); global on every rank."""
        raise NotImplementedError(f"the {self.name} learner has no held-out evaluation")

    @abc.abstractmethod
    def policy_weights(self) -> contextlib.AbstractContextManager[dict[str, torch.Tensor]]:
        """Context manager yielding the policy's weights in checkpoint naming, as vLLM loads them."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Training state besides the weights (optimiser, scheduler, RNG, version, ...)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``state_dict()`` output."""

    @abc.abstractmethod
    def save(self, folder: str | Path, tokenizer_from: str | None = None) -> Path:
        """Writes a servable model folder plus everything ``restore`` needs (see module doc)."""

    @abc.abstractmethod
    def restore(self, folder: str | Path) -> None:
        """Loads weights and training state from a folder written by ``save``."""

    def check_batch(self, batch: Experience) -> None:
        missing = [f for f in self.required_fields if getattr(batch, f) is None]
        if missing:
            raise ExperienceError(f"the {self.name} learner needs {', '.join(missing)} in every batch")


def register_learner(name: str, target: str) -> None:
    """Registers (or replaces) a learner: ``target`` is its ``"module:Class"``."""
    if target.count(":") != 1:
        raise ValueError(f"learner {name!r}: target must be 'module:Class', got {target!r}")
    LEARNERS[name] = target


def unregister_learner(name: str) -> None:
    LEARNERS.pop(name, None)


class UnknownLearner(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def learner_target(name: str) -> str:
    """The ``"module:Class"`` registered under ``name``; UnknownLearner names the registered ones."""
    if name not in LEARNERS:
        raise UnknownLearner(f"unknown learner {name!r}; registered: {', '.join(sorted(LEARNERS))}")
    return LEARNERS[name]


def load_learner_class(target: str) -> type[Learner]:
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def get_learner(name: str) -> type[Learner]:
    """The learner class registered under ``name``."""
    return load_learner_class(learner_target(name))


def save_learner_state(folder: str | Path, state: dict[str, Any]) -> Path:
    path = Path(folder) / TRAINER_STATE_DIR / LEARNER_STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def load_learner_state(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / TRAINER_STATE_DIR / LEARNER_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder} holds no learner state ({TRAINER_STATE_DIR}/{LEARNER_STATE_FILE})")
    # Tensors, numbers, strings and containers only: no code runs while loading. Onto the CPU:
    # the optimiser moves its state to its parameters' device.
    return torch.load(path, weights_only=True, map_location="cpu")


def load_model_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every top-level ``*.safetensors`` of a model folder (sharded or not), as vLLM reads it."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out
