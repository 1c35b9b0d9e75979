"""Reward shaping and advantage estimation for PPO-style RLHF.

Layout convention: every per-token tensor is ``(B, T)`` aligned to token
positions of the full sequence; ``mask`` ``(B, T)`` is 1 / True at response
tokens that train and 0 elsewhere. Masks may be bool or float.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from learners.objectives.registry import Registry
from learners.objectives.losses import kl_penalty, masked_whiten

__all__ = [
    "kl_shaped_rewards",
    "gae_advantages",
    "ESTIMATORS",  # noqa: F822 (module __getattr__: a view of the registry)
    "GROUP_ESTIMATORS",  # noqa: F822
    "AdvantageInputs",
    "Estimate",
    "EstimatorSpec",
    "register_estimator",
    "unregister_estimator",
    "get_estimator",
    "estimator_names",
    "needs_group",
    "needs_critic",
    "group_baseline_advantages",
    "reinforce_pp_advantages",
    "discounted_returns",
    "teacher_advantages",
    "episode_mask",
    "bootstrap_positions",
    "token_rewards_from_scores",
    "q_learning_targets",
]


# ------------------------------------------------------------- estimator registry --
# An advantage estimator is one function decorated with ``register_estimator``: it reads the
# global batch (``AdvantageInputs``) and returns an ``Estimate``. ``ppo.advantage_estimator``
# names it; the PPO learner looks it up and calls it, and the config accepts every name here.


class AdvantageInputs(NamedTuple):
    """What an estimator may read: the global batch's tensors and the settings they use.

    ``scores`` and ``group_ids`` are ``(B,)``; ``mask``, ``logprobs`` (the old policy's, before
    the step's first update), ``ref_logprobs`` and ``values`` (the old values; zeros without a
    critic) are ``(B, T)``. ``kl_coef`` is the KL penalty's coefficient of this step,
    ``kl_estimator`` its estimator (``kl_penalty``), ``reward_clip`` the bound of the scores;
    ``gamma``, ``lam`` and ``whiten`` (whiten GAE's advantages) as in ``ppo.*``."""

    scores: Tensor
    group_ids: Tensor
    mask: Tensor
    logprobs: Tensor
    ref_logprobs: Tensor
    values: Tensor
    kl_coef: float
    kl_estimator: str = "k1"
    reward_clip: float = 10.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = True


class Estimate(NamedTuple):
    """An estimator's result, all ``(B, T)``: the advantages, the value targets (zeros for a
    critic-free estimator) and the per-token KL penalty it charged (0 at masked positions)."""

    advantages: Tensor
    returns: Tensor
    kl: Tensor


class EstimatorSpec(NamedTuple):
    """A registered estimator: its function and what it needs of the run (``needs_group``:
    several samples per prompt; ``needs_critic``: a value function, trained on ``returns``)."""

    name: str
    fn: Callable[[AdvantageInputs], Estimate]
    needs_group: bool
    needs_critic: bool


_ESTIMATORS: Registry[EstimatorSpec] = Registry("advantage estimator")


def register_estimator(
    name: str, *, needs_group: bool = False, needs_critic: bool = False
) -> Callable[[Callable[[AdvantageInputs], Estimate]], Callable[[AdvantageInputs], Estimate]]:
    """Decorator: register ``fn(inputs: AdvantageInputs) -> Estimate`` as estimator ``name``."""

    def add(fn: Callable[[AdvantageInputs], Estimate]) -> Callable[[AdvantageInputs], Estimate]:
        _ESTIMATORS.add(name, EstimatorSpec(name, fn, needs_group, needs_critic))
        return fn

    return add


def unregister_estimator(name: str) -> None:
    """Remove estimator ``name`` (e.g. one a test registered); KeyError if there is none."""
    _ESTIMATORS.remove(name)


def estimator_names() -> tuple[str, ...]:
    """Every registered estimator, in registration order."""
    return _ESTIMATORS.names()


def get_estimator(name: str) -> EstimatorSpec:
    """The estimator registered as ``name``; a one-line ValueError naming the known ones."""
    return _ESTIMATORS.get(name)


def needs_group(name: str) -> bool:
    """Whether estimator ``name`` baselines against a prompt's other samples (needs
    ``rollout.samples_per_prompt > 1``)."""
    return get_estimator(name).needs_group


def needs_critic(name: str) -> bool:
    """Whether estimator ``name`` reads a value function (the learner trains a critic)."""
    return get_estimator(name).needs_critic


def __getattr__(name: str) -> tuple[str, ...]:
    # ESTIMATORS / GROUP_ESTIMATORS: views of the registry at the moment they are read.
    if name == "ESTIMATORS":
        return estimator_names()
    if name == "GROUP_ESTIMATORS":
        return tuple(n for n, spec in _ESTIMATORS.items() if spec.needs_group)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _shaped_rewards(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """``kl_shaped_rewards`` of the inputs: per-token ``(rewards, kl)``."""
    return kl_shaped_rewards(
        x.scores, x.logprobs, x.ref_logprobs, x.mask, x.kl_coef, kl_kind=x.kl_estimator, score_clip=x.reward_clip
    )


def kl_shaped_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    beta: float,
    kl_kind: str = "k1",
    score_clip: Optional[float] = None,
) -> tuple[Tensor, Tensor]:
    """Per-token rewards: KL penalty at every token, task score at the last one.

    ``r_t = -beta * KL_t + [t == last valid token] * clip(score)``
    (Ziegler et al. 2019 / Ouyang et al. 2022 reward shaping), where
    ``KL_t = kl_penalty(logprobs, ref_logprobs, kl_kind)`` masked to 0 outside
    ``mask``. The score is added at the LAST position of each row where
    ``mask`` is nonzero; rows with an all-zero mask receive no score.

    Args:
        scores: ``(B,)`` task reward per sequence.
        logprobs: ``(B, T)`` rollout-policy log-probs of the sampled tokens.
        ref_logprobs: ``(B, T)`` reference-policy log-probs of the same tokens.
        mask: ``(B, T)``; bool or float.
        beta: KL coefficient.
        kl_kind: estimator, one of ``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``.
        score_clip: if given, scores are clamped to ``[-score_clip, score_clip]``.

    Returns:
        ``(rewards, kl)``, both ``(B, T)``; both are 0 at masked positions.
    """
    if logprobs.shape != ref_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: logprobs {tuple(logprobs.shape)}, "
            f"ref_logprobs {tuple(ref_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    if scores.shape != logprobs.shape[:1]:
        raise ValueError(f"scores must be (B,)={tuple(logprobs.shape[:1])}, got {tuple(scores.shape)}")
    valid = mask.to(logprobs.dtype) != 0
    # where, not a multiply: padding log-probs may be -inf and 0 * inf = NaN.
    kl = torch.where(valid, kl_penalty(logprobs, ref_logprobs, kl_kind), torch.zeros_like(logprobs))
    rewards = -beta * kl

    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    T = logprobs.shape[1]
    positions = torch.arange(T, device=logprobs.device).expand_as(valid)
    # -1 for an all-zero row matches no position, so that row gets no score
    # (and no data-dependent branching / host sync is needed).
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=1)
    is_last = positions == last.unsqueeze(1)
    rewards = rewards + torch.where(is_last, scores.to(rewards.dtype).unsqueeze(1), torch.zeros_like(rewards))
    return rewards, kl


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, eq. 16).

    ``delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)``,
    ``A_t = delta_t + gamma * lam * A_{t+1}``, ``returns_t = A_t + V(s_t)``.

    Positions with ``mask == 0`` are SKIPPED: they contribute neither reward
    nor value, and "t+1" means the next position > t with ``mask == 1``. So
    prompt tokens, interior masked tokens and trailing padding are transparent,
    and the last valid token of each row bootstraps from value 0 (terminal).
    Implemented as a backward loop over T, vectorised over B with
    ``torch.where``, carrying the next valid token's value and advantage.

    Inputs are detached (advantages and returns are regression/policy-gradient
    targets, never differentiated through). Computation happens in at least
    float32 because a length-T recurrence in bf16 accumulates visible error.

    Args:
        rewards: ``(B, T)`` per-token rewards r_t (e.g. from ``kl_shaped_rewards``).
        values: ``(B, T)`` value estimates V(s_t) from the rollout.
        mask: ``(B, T)``; bool or float.
        gamma: discount factor.
        lam: GAE lambda (bias/variance trade-off).

    Returns:
        ``(advantages, returns)``, both ``(B, T)``, 0 at masked positions,
        dtype ``promote(rewards, values, float32)``.
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"expected matching (B, T) shapes: rewards {tuple(rewards.shape)}, "
            f"values {tuple(values.shape)}, mask {tuple(mask.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    with torch.no_grad():
        r = rewards.detach().to(dtype)
        v = values.detach().to(dtype)
        valid = mask.detach() != 0
        B, T = r.shape
        zeros = torch.zeros(B, dtype=dtype, device=r.device)
        next_value = zeros
        next_adv = zeros
        advs_reversed: list[Tensor] = []
        for t in range(T - 1, -1, -1):
            m_t = valid[:, t]
            delta = r[:, t] + gamma * next_value - v[:, t]
            adv_t = delta + gamma * lam * next_adv
            # where (not multiply) so garbage at skipped positions can't leak
            # into the carry even if it is inf/NaN.
            advs_reversed.append(torch.where(m_t, adv_t, zeros))
            next_value = torch.where(m_t, v[:, t], next_value)
            next_adv = torch.where(m_t, adv_t, next_adv)
        advantages = (
            torch.stack(advs_reversed[::-1], dim=1) if T > 0 else torch.zeros(B, 0, dtype=dtype, device=r.device)
        )
        returns = torch.where(valid, advantages + v, torch.zeros_like(advantages))
    return advantages, returns


@register_estimator("gae", needs_critic=True)
def _gae_estimate(x: AdvantageInputs) -> Estimate:
    """PPO with a critic: KL-shaped per-token rewards, GAE, whitened over the batch's response
    tokens with ``whiten`` (and more than one of them)."""
    rewards, kl = _shaped_rewards(x)
    advantages, returns = gae_advantages(rewards, x.values, x.mask, gamma=x.gamma, lam=x.lam)
    if x.whiten and int(x.mask.sum()) > 1:
        advantages = masked_whiten(advantages, x.mask) * x.mask
    return Estimate(advantages, returns, kl)


# --------------------------------------------------- critic-free estimators --

#: The estimators ``group_baseline_advantages`` implements: one scalar
#: advantage per sequence, baselined against the other samples of its prompt.
#: (``ESTIMATORS`` and ``GROUP_ESTIMATORS``, every registered estimator and those that need a
#: group, are read from the registry: see ``__getattr__``.)
_GROUP_BASELINES: tuple[str, ...] = ("grpo", "dr_grpo", "rloo")


def group_baseline_advantages(
    scores: Tensor, group_ids: Tensor, mask: Tensor, *, estimator: str, eps: float = 1e-6
) -> Tensor:
    """Critic-free per-sequence advantages with a per-prompt (group) baseline.

    Rows sharing a value of ``group_ids`` are samples of the same prompt (a
    "group" g with ``n_g`` members). With ``r`` the score of a row and
    ``mean_g`` / ``std_g`` the mean / unbiased standard deviation of the
    scores of its group:

    * ``"grpo"`` -- GRPO outcome supervision (Shao et al. 2024, DeepSeekMath,
      sec. 4.1.2): ``A = (r - mean_g) / (std_g + eps)``. ``std_g`` uses
      Bessel's correction (``torch.std``'s default, as the reference
      implementations do).
    * ``"dr_grpo"`` -- Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
      Training: A Critical Perspective"): ``A = r - mean_g``. Dropping the std
      division removes GRPO's question-level difficulty bias (groups with
      nearly equal scores are no longer up-weighted).
    * ``"rloo"`` -- REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al.
      2024, "Back to Basics"): ``A_i = r_i - (sum_g r - r_i) / (n_g - 1)
      = n_g / (n_g - 1) * (r_i - mean_g)``. The baseline excludes the sample
      itself, so it is independent of that sample and the estimator unbiased.

    A group of size 1 has no baseline to compare against and gets advantage 0
    under every estimator, as does a group whose scores are all equal (exactly
    0, not merely small: the scores are shifted by their group max before
    averaging, because the float mean of n copies of x is not always x, and
    GRPO's ``/ (std_g + eps)`` would amplify that rounding error by up to
    ``1 / eps``). The result is never NaN, even with ``eps = 0``: where
    ``std_g == 0`` the GRPO advantage is 0.

    Group membership need not be contiguous and ids are arbitrary integers;
    grouping is vectorised with ``torch.unique(return_inverse=True)`` plus
    ``index_add_`` (``torch.unique`` synchronises with the host once).

    The per-sequence advantage is broadcast to every response token (the same
    value at each position where ``mask`` is nonzero, 0 elsewhere), ready for
    ``policy_loss_clipped``. Scores are detached and the computation runs in
    at least float32. A sequence-level KL term, if wanted, must already be in
    ``scores``.

    Args:
        scores: ``(B,)`` task reward per sequence.
        group_ids: ``(B,)`` integer prompt/group id per sequence.
        mask: ``(B, T)``; bool or float.
        estimator: ``"grpo"``, ``"dr_grpo"`` or ``"rloo"``.
        eps: added to ``std_g`` for ``"grpo"`` (ignored otherwise); >= 0.

    Returns:
        ``(B, T)`` advantages, 0 at masked positions, dtype
        ``promote(scores, float32)``.

    Raises:
        ValueError: for an unknown estimator, mismatched shapes, floating
            point ``group_ids`` or negative ``eps``.
    """
    _check_group_args(scores, group_ids, mask, estimator, eps)
    dtype = torch.promote_types(scores.dtype, torch.float32)
    with torch.no_grad():
        r = scores.detach().to(dtype)
        valid = mask.detach() != 0
        unique_ids, inverse = torch.unique(group_ids.detach(), return_inverse=True)
        num_groups = unique_ids.numel()
        group_zeros = torch.zeros(num_groups, dtype=dtype, device=r.device)

        # Shift by the group max: exact 0 for all-equal groups (see docstring)
        # and less cancellation in the sums when scores are large.
        shift = group_zeros.scatter_reduce(0, inverse, r, reduce="amax", include_self=False)
        x = r - shift[inverse]
        counts = group_zeros.index_add(0, inverse, torch.ones_like(r))
        mean = group_zeros.index_add(0, inverse, x) / counts.clamp(min=1)
        centered = x - mean[inverse]
        n = counts[inverse]

        if estimator == "grpo":
            # Two-pass (centered) variance: no E[x^2] - E[x]^2 cancellation.
            sq = group_zeros.index_add(0, inverse, centered.square())
            std = (sq / (counts - 1).clamp(min=1)).sqrt()[inverse]
            # n == 1 gives centered == 0 and std == 0; where() keeps 0/0 out
            # when eps == 0.
            adv = torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))
        elif estimator == "dr_grpo":
            adv = centered
        else:  # "rloo"
            # n/(n-1) * (r - mean) is the leave-one-out form rewritten so that
            # it needs only the group sum; n == 1 -> centered == 0 -> 0.
            adv = torch.where(n > 1, centered * n / (n - 1).clamp(min=1), torch.zeros_like(centered))

        advantages = torch.where(valid, adv.unsqueeze(1), torch.zeros((), dtype=dtype, device=r.device))
    return advantages


def _check_group_args(scores: Tensor, group_ids: Tensor, mask: Tensor, estimator: str, eps: float) -> None:
    """``group_baseline_advantages``'s ValueErrors: an unknown estimator, mismatched shapes,
    floating point ``group_ids`` or negative ``eps``."""
    if estimator not in _GROUP_BASELINES:
        hint = ""
        if estimator == "gae":
            hint = " ('gae' needs a critic: use gae_advantages)"
        elif estimator == "reinforce_pp":
            hint = " ('reinforce_pp' is token-level: use reinforce_pp_advantages)"
        raise ValueError(f"Unknown group-baseline estimator {estimator!r}; expected one of {_GROUP_BASELINES}{hint}")
    if mask.dim() != 2:
        raise ValueError(f"mask must be (B, T), got {tuple(mask.shape)}")
    B = mask.shape[0]
    if scores.shape != (B,) or group_ids.shape != (B,):
        raise ValueError(
            f"scores and group_ids must be (B,)=({B},), got {tuple(scores.shape)} and {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def _group_estimate(kind: str) -> Callable[[AdvantageInputs], Estimate]:
    """Estimator ``kind`` of ``group_baseline_advantages``: group baselines work on sequence
    rewards, so the KL penalty enters as its sequence sum."""

    def estimate(x: AdvantageInputs) -> Estimate:
        kl = kl_penalty(x.logprobs, x.ref_logprobs, x.kl_estimator) * x.mask
        seq_rewards = x.scores.clamp(-x.reward_clip, x.reward_clip) - x.kl_coef * kl.sum(1)
        advantages = group_baseline_advantages(seq_rewards, x.group_ids, x.mask, estimator=kind)
        return Estimate(advantages, torch.zeros_like(x.logprobs), kl)

    estimate.__name__ = estimate.__qualname__ = f"_{kind}_estimate"
    return estimate


for _kind in _GROUP_BASELINES:
    register_estimator(_kind, needs_group=True)(_group_estimate(_kind))


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Masked return-to-go ``G_t = r_t + gamma * G_{t+1}`` over valid tokens.

    Positions with ``mask == 0`` are skipped exactly as in ``gae_advantages``:
    they add no reward, do not discount, output 0, and pass the running
    return of the next valid token through. Rows are independent; the last
    valid token of each row is terminal (``G = r``). Loop over T, vectorised
    over B. Inputs are detached; computed in ``promote(rewards, float32)``.

    Args:
        rewards: ``(B, T)`` per-token rewards.
        mask: ``(B, T)``; bool or float.
        gamma: discount factor.

    Returns:
        ``(B, T)`` returns, 0 at masked positions.
    """
    if rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(f"expected matching (B, T) shapes: rewards {tuple(rewards.shape)}, mask {tuple(mask.shape)}")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    with torch.no_grad():
        r = rewards.detach().to(dtype)
        valid = mask.detach() != 0
        B, T = r.shape
        zeros = torch.zeros(B, dtype=dtype, device=r.device)
        next_return = zeros
        returns_reversed: list[Tensor] = []
        for t in range(T - 1, -1, -1):
            m_t = valid[:, t]
            ret_t = r[:, t] + gamma * next_return
            # where (not multiply) so inf/NaN rewards at skipped positions
            # cannot leak into the carry.
            returns_reversed.append(torch.where(m_t, ret_t, zeros))
            next_return = torch.where(m_t, ret_t, next_return)
        returns = (
            torch.stack(returns_reversed[::-1], dim=1) if T > 0 else torch.zeros(B, 0, dtype=dtype, device=r.device)
        )
    return returns


def teacher_advantages(
    student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, discount: float = 0.0, center: bool = False
) -> Tensor:
    """On-policy distillation: the advantage of each sampled token under the per-token reverse KL
    to a teacher, ``A_t = sum_{k>=t} discount^(k-t) (log pi_T(y_k) - log pi_S(y_k))``.

    The student samples ``y``; ``-(log pi_S - log pi_T)`` at a sampled token is the one-sample
    estimate of the reverse KL ``KL(pi_S || pi_T)`` at that position, so a policy gradient on this
    advantage minimises the sequence-level reverse KL on the student's own distribution (GKD,
    Agarwal et al. 2024, with lambda = 1 and the reverse KL; MiniLLM, Gu et al. 2024, eq. 2-5).
    ``discount=0`` (the default, as in Thinking Machines' "On-Policy Distillation", 2025) credits
    each token with its own term only; ``discount=1`` with the whole remaining sequence's.

    ``center``: subtract the batch's mean over response tokens (a constant baseline: the sampled
    gradient keeps its expectation, ``E[grad log pi] = 0``, and loses the variance of a term that
    is negative almost everywhere, the student's own tokens being likelier under the student).

    Edge cases: positions with ``mask == 0`` (prompt, padding, observation tokens) give 0 and
    pass the running sum through, as ``discounted_returns``; a row with no response token is all
    0. Inputs are detached (the advantage is a constant of the policy loss).

    Args:
        student_logprobs: ``(B, T)`` log-probs of the sampled tokens under the student (the
            policy that sampled them, or the learner's old pass).
        teacher_logprobs: ``(B, T)`` the same tokens' log-probs under the teacher.
        mask: ``(B, T)`` response tokens.
        discount: weight of later tokens' terms, in ``[0, 1]``.
    """
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"student {tuple(student_logprobs.shape)} and teacher {tuple(teacher_logprobs.shape)} log-probs differ in shape"
        )
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    gap = (teacher_logprobs.detach() - student_logprobs.detach()).float()
    adv = discounted_returns(torch.where(mask.detach() != 0, gap, torch.zeros_like(gap)), mask, discount)
    if center and bool((mask != 0).any()):
        valid = mask.detach() != 0
        adv = torch.where(valid, adv - adv[valid].mean(), torch.zeros_like(adv))
    return adv


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ advantages (Hu 2025, arXiv:2501.03262): no critic, global whitening.

    ``G_t = sum_{s >= t, mask_s != 0} gamma^(k(s) - k(t)) * r_s`` is the
    discounted return-to-go over valid tokens (``k`` counts valid tokens, so
    masked positions are skipped exactly as in ``gae_advantages``: they carry
    the running return through without adding reward or discount), and

    ``A_t = (G_t - mean(G)) / std(G)``

    with the masked mean and unbiased std taken over ALL valid tokens of the
    batch (``masked_whiten``). Normalising across the whole batch instead of
    per prompt is what distinguishes REINFORCE++ from GRPO: the paper argues
    the per-prompt std overfits easy prompts and a global statistic is more
    stable. Hence the caller must pass the WHOLE batch (all prompts and all
    samples of the update), not micro-batches or single groups, or the
    statistics are no longer global. The per-token rewards are typically the
    KL-shaped ones from ``kl_shaped_rewards`` (``-beta * KL_t`` at each token,
    the score added at the last response token).

    Inputs are detached and computed in at least float32. No NaN: an all-zero
    mask, a single valid token or constant returns give 0 (the whitening
    variance is 0 and ``masked_whiten`` adds eps 1e-8 before rsqrt).

    Args:
        rewards: ``(B, T)`` per-token rewards r_t.
        mask: ``(B, T)``; bool or float (nonzero = valid; masked output is
            zeroed with ``where``, equal to multiplying by a 0/1 mask).
        gamma: discount factor.

    Returns:
        ``(B, T)`` advantages, 0 at masked positions, dtype
        ``promote(rewards, float32)``.
    """
    returns = discounted_returns(rewards, mask, gamma)
    with torch.no_grad():
        valid = mask.detach() != 0
        whitened = masked_whiten(returns, valid.to(returns.dtype))
        advantages = torch.where(valid, whitened, torch.zeros_like(whitened))
    return advantages


@register_estimator("reinforce_pp")
def _reinforce_pp_estimate(x: AdvantageInputs) -> Estimate:
    """REINFORCE++ on the KL-shaped per-token rewards of the whole batch; no value targets."""
    rewards, kl = _shaped_rewards(x)
    return Estimate(reinforce_pp_advantages(rewards, x.mask, gamma=x.gamma), torch.zeros_like(x.logprobs), kl)


# -- token-level Q-learning -------------------------------------------------------------------------
# Each response token is an action a_t taken in state s_t (the prompt and the tokens before it);
# Q(s_t, .) is the policy's output logits at the position that predicts token t. Per-token tensors
# keep the (B, T) layout above: position t holds the quantity of the action input_ids[:, t].


def episode_mask(input_ids: Tensor, response_mask: Tensor, eos_token_ids: list[int]) -> tuple[Tensor, Tensor]:
    """The actions that train: each turn's response tokens up to and including its first EOS.

    A turn is a contiguous run of response tokens (a multi-turn episode has one per model turn,
    with the environment's observation tokens between them; a single reply is one turn). An EOS
    ends its turn: later positions of the same run (a logged sequence that kept going, padding
    written as EOS) are no actions and carry no loss; the next turn starts after the observation.

    Args:
        input_ids: ``(B, T)`` int64.
        response_mask: ``(B, T)`` bool.
        eos_token_ids: token ids that end a turn.
    Returns:
        ``(mask, ended)``: ``(B, T)`` bool mask, and ``(B,)`` bool, True where the last kept
        action is an EOS token (a terminal state).
    """
    rm = response_mask.bool()
    is_eos = torch.zeros_like(rm)
    for e in eos_token_ids:
        is_eos |= input_ids == e
    eos_in_resp = (is_eos & rm).long()
    # EOS tokens strictly before t, counted from the start of t's turn.
    before = torch.cumsum(eos_in_resp, dim=1) - eos_in_resp
    starts = rm & ~torch.cat([torch.zeros_like(rm[:, :1]), rm[:, :-1]], dim=1)
    base = torch.cummax(torch.where(starts, before, torch.zeros_like(before)), dim=1).values
    mask = rm & (before - base == 0)
    T = mask.shape[1]
    last = (T - 1 - torch.argmax(mask.flip(1).long(), dim=1)).clamp(min=0)
    ended = mask.any(1) & is_eos.gather(1, last[:, None]).squeeze(1)
    return mask, ended


def token_rewards_from_scores(scores: Tensor, mask: Tensor) -> Tensor:
    """``(B, T)`` rewards: each sequence's score ``(B,)`` at its last action, 0 elsewhere (a
    sparse terminal reward, as verifiers and reward models give)."""
    valid = mask.bool()
    T = valid.shape[1]
    last = (T - 1 - torch.argmax(valid.flip(1).long(), dim=1)).clamp(min=0)
    out = torch.zeros(valid.shape, dtype=torch.promote_types(scores.dtype, torch.float32), device=scores.device)
    out[torch.arange(len(scores), device=out.device), last] = scores.to(out.dtype)
    return torch.where(valid, out, torch.zeros_like(out))


def bootstrap_positions(mask: Tensor) -> Tensor:
    """``(B, T)`` bool: where ``q_learning_targets`` reads ``next_max_q``: every action, and the
    position just before each turn that follows an earlier action (the last observation token,
    whose logits are the Q-values of that turn's first action)."""
    valid = mask.bool()
    prev = torch.cat([torch.zeros_like(valid[:, :1]), valid[:, :-1]], dim=1)
    starts = valid & ~prev & (torch.cumsum(valid.long(), dim=1) > 1)
    before = torch.cat([starts[:, 1:], torch.zeros_like(starts[:, :1])], dim=1)
    return valid | before


def reads_bootstrap(mask: Tensor, done: Tensor, n_step: int) -> bool:
    """Whether ``q_learning_targets(..., mask, done, n_step=n_step)`` reads ``next_max_q`` at all.

    An action's n-step window bootstraps unless it reaches the last action of a finished episode;
    the first action's window is the longest, so no action bootstraps when every row is ``done``
    and holds at most ``n_step`` actions (e.g. Monte-Carlo targets over whole episodes: the
    target network's pass can be skipped). Rows without actions read nothing.

    Args:
        mask: ``(B, T)`` actions; done: ``(B,)`` bool; n_step: as in ``q_learning_targets``.
    """
    counts = mask.detach().bool().sum(1)
    acting = counts > 0
    return bool((acting & ((counts > n_step) | ~done.detach().bool())).any())


def q_learning_targets(
    rewards: Tensor,
    next_max_q: Tensor,
    mask: Tensor,
    done: Tensor,
    *,
    gamma: float = 1.0,
    n_step: int = 1,
    mc_lower_bound: bool = False,
) -> Tensor:
    """n-step Bellman targets of token actions, optionally bounded below by the Monte-Carlo return.

    One step (Watkins' Q-learning; Q-Transformer, Chebotar et al. 2023, eq. 1 per action
    dimension, here per token)::

        y_t = r_t + gamma * max_a Q_target(s_{t+1}, a)     (t before the last action)
        y_T = r_T                                          (last action of a finished episode)
        y_T = r_T + gamma * max_a Q_target(s_{T+1}, a)     (last action of a sequence cut at a
                                                            length limit: the episode goes on)

    n steps (Sutton & Barto 2018, eq. 7.1), ``j = min(n, T - t + 1)`` rewards before the tail::

        y_t = sum_{k<j} gamma^k r_{t+k} + gamma^j * B_{t+j-1}

    where ``B_u = max_a Q_target(s_{u+1}, a)`` and ``B_T = 0`` for a finished episode. With
    ``mc_lower_bound`` (Q-Transformer sec. 4.3): ``y_t <- max(y_t, G_t)``, ``G_t = sum_{k>=t}
    gamma^(k-t) r_k`` the observed return: the return of a behaviour that was actually seen
    bounds the optimal value from below (for a cut sequence, when later rewards are >= 0),
    which speeds up the propagation of sparse terminal rewards.

    Args:
        rewards: ``(B, T)`` per-token rewards r_t (0 where none is given).
        next_max_q: ``(B, T)``; at position t, ``max_a Q_target(s_{t+1}, a)``: the maximum of the
            target network's logits at the position *of* token t (the state after it).
        mask: ``(B, T)`` actions. Actions need not be adjacent: in a multi-turn episode the
            environment's observation tokens lie between turns. They are no actions, and the
            backup of a turn's last action bootstraps from the state before the next turn's first
            action (the logits at the observation's last token), discounted as one step.
        done: ``(B,)`` bool, True where the last action ends the episode (no bootstrap).
        gamma: discount factor in [0, 1].
        n_step: number of rewards summed before bootstrapping (>= 1).
        mc_lower_bound: bound the targets below by the observed return.
    Returns:
        ``(B, T)`` targets (no gradient), 0 outside ``mask``, dtype promote(rewards, float32).
    """
    if rewards.shape != mask.shape or next_max_q.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"expected matching (B, T) shapes: rewards {tuple(rewards.shape)}, "
            f"next_max_q {tuple(next_max_q.shape)}, mask {tuple(mask.shape)}"
        )
    if n_step < 1:
        raise ValueError(f"n_step must be >= 1, got {n_step}")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    with torch.no_grad():
        valid = mask.detach().bool()
        B, T = valid.shape
        if T == 0:
            return torch.zeros(B, 0, dtype=dtype, device=rewards.device)
        zero = torch.zeros((), dtype=dtype, device=rewards.device)
        # Actions packed to the left of each row: the i-th column is the row's i-th action, so
        # "the next action" is the next column also across a multi-turn episode's observations.
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        packed = valid.gather(1, order)
        r = torch.where(packed, rewards.detach().to(dtype).gather(1, order), zero)
        # The state before action i+1 is the logits' position just before it (after the
        # observation); for adjacent actions that is action i's own position.
        has_next = torch.cat([packed[:, 1:], torch.zeros_like(packed[:, :1])], dim=1)
        source = torch.where(has_next, torch.cat([order[:, 1:], order[:, -1:]], dim=1) - 1, order)
        next_q = next_max_q.detach().to(dtype).gather(1, source)
        valid = packed
        pos = torch.arange(T, device=r.device).expand(B, T)
        last = (T - 1 - torch.argmax(valid.flip(1).long(), dim=1))[:, None]  # (B, 1)
        y = torch.zeros_like(r)
        for k in range(n_step):
            idx = (pos + k).clamp(max=T - 1)
            in_episode = valid & (pos + k <= last)
            y = y + torch.where(in_episode, (gamma**k) * r.gather(1, idx), zero)
        j = torch.minimum(torch.full_like(pos, n_step), last - pos + 1).clamp(min=1)
        tail = (pos + j - 1).clamp(max=T - 1)
        boot = next_q.gather(1, tail)
        boot = torch.where((tail == last) & done.bool()[:, None], zero, boot)
        y = y + torch.pow(torch.full_like(y, gamma), j.to(dtype)) * boot
        if mc_lower_bound:
            y = torch.maximum(y, discounted_returns(r, valid, gamma))
        y = torch.where(valid, y, zero)
        return torch.zeros_like(y).scatter(1, order, y)
