"""Shared test factories: tiny ragged batches, experience records and learners.

Every unit test that needs a batch or a learner builds it here, so the shapes that real
rollouts have (ragged, right-padded responses; groups of unequal size) are written once.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cluster.config import DPOConfig, LoRAConfig, PPOConfig, QLearnConfig, RewardModelConfig, SFTConfig, TrainConfig
from learners.base import LearnerContext
from learners.training.distributed import Collective
from learners.experience import Experience
from learners.training.modeling import sequence_logprobs


def ragged_batch(vocab: int, b: int = 6, prompt: int = 5, resp: int = 7, seed: int = 0):
    """(input_ids, attention_mask, response_mask): random tokens, responses of length resp,
    resp-1, resp-2 (cycling), right-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, prompt + resp), generator=g)
    att = torch.ones_like(ids, dtype=torch.bool)
    rm = torch.zeros_like(att)
    rm[:, prompt:] = True
    for i in range(b):
        cut = prompt + resp - (i % 3)
        att[i, cut:] = False
        rm[i, cut:] = False
        ids[i, cut:] = 0
    return ids, att, rm


def grouped_batch(vocab: int, groups: Sequence[int], prompt_lens: dict[int, int] | None = None, seed: int = 0):
    """Rows whose ``groups`` entries are equal share a prompt (as a prompt's samples do), with
    ragged responses; groups may be interleaved. Returns ids, attention mask, response mask."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = prompt_lens or {}
    prompts = {
        gid: torch.randint(3, vocab, (prompt_lens.get(gid, 4 + k % 3),), generator=g)
        for k, gid in enumerate(dict.fromkeys(groups))
    }
    resp_lens = [2 + (i * 5) % 6 for i in range(len(groups))]
    length = max(len(prompts[gid]) + r for gid, r in zip(groups, resp_lens)) + 1
    ids = torch.zeros(len(groups), length, dtype=torch.long)
    att = torch.zeros(len(groups), length, dtype=torch.bool)
    rm = torch.zeros_like(att)
    for i, (gid, r) in enumerate(zip(groups, resp_lens)):
        p = prompts[gid]
        ids[i, : len(p)] = p
        ids[i, len(p) : len(p) + r] = torch.randint(3, vocab, (r,), generator=g)
        att[i, : len(p) + r] = True
        rm[i, len(p) : len(p) + r] = True
    return ids, att, rm


def experience(
    lm: Any,
    ids: torch.Tensor,
    att: torch.Tensor,
    rm: torch.Tensor,
    scores: Sequence[float],
    *,
    groups: Sequence[int] | None = None,
    truncated: Sequence[bool] | None = None,
    ref_shift: float | None = 0.0,
    version: int = 0,
) -> Experience:
    """A scored record whose rollout log-probs are ``lm``'s own (an on-policy batch);
    ``ref_shift``: reference log-probs = rollout log-probs - shift (None: no reference)."""
    with torch.no_grad():
        lp = sequence_logprobs(lm, ids, att, rm)
    b = ids.shape[0]
    return Experience(
        input_ids=ids,
        attention_mask=att,
        response_mask=rm,
        rollout_logprobs=lp,
        group_ids=torch.tensor(list(groups) if groups is not None else list(range(b))),
        truncated=torch.tensor(list(truncated) if truncated is not None else [False] * b),
        policy_version=version,
        completions=[""] * b,
        meta=[{}] * b,
        scores=torch.tensor(list(scores), dtype=torch.float32),
        ref_logprobs=None if ref_shift is None else lp - ref_shift,
    ).validate()


def tiny_lm(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def make_learner(
    path: str,
    *,
    train: dict | None = None,
    ppo: dict | None = None,
    lora: dict | None = None,
    comm: Collective | None = None,
    seed: int = 0,
    total_steps: int = 10,
    max_new_tokens: int = 16,
):
    """A PPO learner on the tiny model; ``train``/``ppo``/``lora`` override config fields."""
    from learners.ppo import PPOLearner

    tr = TrainConfig(**{"bf16": False, "micro_batch_size": 8, **(train or {})})
    hp = PPOConfig(**(ppo or {}))
    ctx = LearnerContext(
        model_path=path,
        seed=seed,
        total_steps=total_steps,
        max_new_tokens=max_new_tokens,
        lora=LoRAConfig(enabled=True, **lora) if lora else None,
        comm=comm,
    )
    return PPOLearner.build(ctx, tr, hp)


def make_dpo_learner(
    path: str,
    *,
    train: dict | None = None,
    dpo: dict | None = None,
    lora: dict | None = None,
    comm: Collective | None = None,
    seed: int = 0,
    total_steps: int = 10,
):
    """A DPO learner on the tiny model; ``train``/``dpo``/``lora`` override config fields."""
    from learners.dpo import DPOLearner

    tr = TrainConfig(**{"bf16": False, "micro_batch_size": 8, **(train or {})})
    ctx = LearnerContext(
        model_path=path,
        seed=seed,
        total_steps=total_steps,
        lora=LoRAConfig(enabled=True, **lora) if lora else None,
        comm=comm,
    )
    return DPOLearner.build(ctx, tr, DPOConfig(**(dpo or {})))


def make_q_learner(
    path: str,
    *,
    train: dict | None = None,
    qlearn: dict | None = None,
    lora: dict | None = None,
    comm: Collective | None = None,
    seed: int = 0,
    total_steps: int = 10,
):
    """A Q-learning learner on the tiny model; ``train``/``qlearn``/``lora`` override config fields."""
    from learners.qlearn import QLearner

    tr = TrainConfig(**{"bf16": False, "micro_batch_size": 8, **(train or {})})
    ctx = LearnerContext(
        model_path=path,
        seed=seed,
        total_steps=total_steps,
        lora=LoRAConfig(enabled=True, **lora) if lora else None,
        comm=comm,
    )
    return QLearner.build(ctx, tr, QLearnConfig(**(qlearn or {})))


def transitions_batch(
    prompt: Sequence[int],
    episodes: Sequence[tuple[Sequence[int], Sequence[float]]],
    done: Sequence[bool] | None = None,
    pad: int = 0,
) -> Experience:
    """Sequences ``prompt + actions`` with per-token rewards (a logged token MDP), right-padded."""
    n = len(episodes)
    length = len(prompt) + max(len(a) for a, _ in episodes)
    ids = torch.full((n, length), pad, dtype=torch.long)
    att = torch.zeros(n, length, dtype=torch.bool)
    rm = torch.zeros_like(att)
    rewards = torch.zeros(n, length)
    for i, (actions, r) in enumerate(episodes):
        end = len(prompt) + len(actions)
        ids[i, :end] = torch.tensor(list(prompt) + list(actions))
        att[i, :end] = True
        rm[i, len(prompt) : end] = True
        rewards[i, len(prompt) : end] = torch.tensor(list(r), dtype=torch.float32)
    done = list(done) if done is not None else [True] * n
    return Experience(
        input_ids=ids,
        attention_mask=att,
        response_mask=rm,
        rollout_logprobs=torch.zeros(n, length),
        group_ids=torch.arange(n),
        truncated=~torch.tensor(done),
        policy_version=0,
        completions=[""] * n,
        meta=[{}] * n,
        token_rewards=rewards,
    ).validate()


def mdp_batch() -> Experience:
    """The unit tests' small token MDP: prompt 5 6 7; tokens A=10, B=11, C=12, EOS=2 (the tiny
    model's eos_token_id); episodes A C EOS (reward 1 at the end), A EOS (0.3), B EOS (0.1, 0.5)."""
    return transitions_batch([5, 6, 7], [([10, 12, 2], [0, 0, 1.0]), ([10, 2], [0, 0.3]), ([11, 2], [0.1, 0.5])])


def make_sft_learner(
    path: str, *, train: dict | None = None, lora: dict | None = None, seed: int = 0, total_steps: int = 10
):
    """An SFT learner on the tiny model; ``train``/``lora`` override config fields."""
    from learners.sft import SFTLearner

    tr = TrainConfig(**{"bf16": False, "micro_batch_size": 8, **(train or {})})
    ctx = LearnerContext(
        model_path=path, seed=seed, total_steps=total_steps, lora=LoRAConfig(enabled=True, **lora) if lora else None
    )
    return SFTLearner.build(ctx, tr, SFTConfig())


def preference_batch(
    lm: Any, n_pairs: int, *, seed: int = 0, ref_shift: float | None = 0.0, chosen_first: Sequence[bool] | None = None
) -> Experience:
    """``n_pairs`` preference pairs (two rows of one group share a prompt, ragged responses);
    the chosen row scores 1, the rejected 0 (in either order within the pair). Reference
    log-probs are ``lm``'s own minus ``ref_shift`` (None: no reference)."""
    groups = [g for g in range(n_pairs) for _ in (0, 1)]
    ids, att, rm = grouped_batch(lm.config.vocab_size, groups, seed=seed)
    first = chosen_first if chosen_first is not None else [g % 2 == 0 for g in range(n_pairs)]
    scores = [s for f in first for s in ((1.0, 0.0) if f else (0.0, 1.0))]
    return experience(lm, ids, att, rm, scores, groups=groups, ref_shift=ref_shift)


def assert_grads_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """Every reference gradient is non-zero and ``got`` matches it within 3e-4 of that tensor's
    largest entry: float32 sums taken in another order (another kernel, packing) differ by that
    much, a wrong mask or position by the tensor's own scale."""
    assert ref and got.keys() >= ref.keys()
    for n, g in ref.items():
        scale = float(g.abs().max())
        assert scale > 0, n
        torch.testing.assert_close(got[n], g, atol=3e-4 * scale, rtol=1e-4, msg=n)


def flat_grads(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """Every gradient in one vector (zeros for parameters without one)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).clone() for p in params])


def step_with_grads(learner: Any, batch: Experience, comm: Collective | None = None) -> tuple[dict, dict[str, float]]:
    """One ``train_step`` (on rank ``comm`` if given); returns ({"g": the global gradient as the
    optimiser saw it, before clipping}, metrics)."""
    if comm is not None:
        learner.comm = comm
    captured: dict = {}
    learner.on_gradients = lambda params: captured.setdefault("g", flat_grads(params))
    return captured, learner.train_step(batch)


def make_rm_learner(
    path: str,
    *,
    train: dict | None = None,
    rm: dict | None = None,
    comm: Collective | None = None,
    seed: int = 0,
    total_steps: int = 10,
):
    """A reward-model learner on the tiny model; ``train``/``rm`` override config fields."""
    from learners.reward_model import RewardModelLearner

    tr = TrainConfig(**{"bf16": False, "micro_batch_size": 8, **(train or {})})
    ctx = LearnerContext(model_path=path, seed=seed, total_steps=total_steps, comm=comm)
    return RewardModelLearner.build(ctx, tr, RewardModelConfig(**(rm or {})))


def trained_lora(path: str, targets: Sequence[str], *, r: int = 4, scale: float = 0.05, seed: int = 0) -> Any:
    """A peft LoRA model on ``path`` whose adapter has moved: random B (peft starts it at 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(lm, LoraConfig(r=r, lora_alpha=2.0 * r, target_modules=list(targets), bias="none"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model


def taken_logits(logits: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each taken action's logit, each state's logsumexp) of ``(B, T, V)`` logits."""
    return logits.gather(2, actions[..., None]).squeeze(2), torch.logsumexp(logits, 2)
