"""Token-level Q-learning losses: the TD loss and the conservative regularisers."""

from __future__ import annotations

from torch import Tensor


def td_loss(q_taken: Tensor, targets: Tensor) -> Tensor:
    """Per-token temporal-difference loss ``1/2 (Q(s_t, a_t) - y_t)^2`` (Mnih et al. 2015, eq. 2
    with a squared error; targets from ``advantages.q_learning_targets`` carry no gradient).

    Args:
        q_taken: ``(B, T)`` Q of the taken actions (the logit of each response token).
        targets: ``(B, T)`` Bellman targets.
    Returns:
        ``(B, T)`` losses; the caller masks and normalises them.
    """
    return 0.5 * (q_taken - targets.detach()) ** 2


def conservative_penalty(sq_dev_sum: Tensor, q_taken: Tensor, floor: float, vocab_size: int) -> Tensor:
    """Conservative regulariser of Q-Transformer (Chebotar et al. 2023, sec. 4.2, eq. 2): the Q
    of every action *not* taken in the data is pushed toward a floor (the lowest reward), so that
    ``max_a Q`` in the backups never picks an action the data says nothing about::

        R_t = 1/2 * 1/(|V| - 1) * sum_{a != a_t} (Q(s_t, a) - floor)^2

    The sum over the vocabulary comes in as ``sq_dev_sum = sum_a (Q(s_t, a) - floor)^2`` (reduced
    chunk by chunk, ``modeling.q_heads_at_positions``); the taken action's term is removed here.
    Averaging over the |V| - 1 other actions keeps the term's scale independent of the vocabulary,
    so the pull on any one token is tiny and a token sampled twice in a state is barely biased.

    Args:
        sq_dev_sum: ``(B, T)`` ``sum_a (Q(s_t, a) - floor)^2`` over the whole vocabulary.
        q_taken: ``(B, T)`` Q of the taken actions.
        floor: value unseen actions are pushed to (e.g. the minimum reward, 0).
        vocab_size: |V| (>= 2).
    Returns:
        ``(B, T)`` penalties; the caller masks, weights (alpha) and normalises them.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return 0.5 * (sq_dev_sum - (q_taken - floor) ** 2) / (vocab_size - 1)


def cql_penalty(logsumexp_q: Tensor, q_taken: Tensor) -> Tensor:
    """CQL(H) regulariser (Kumar et al. 2020, eq. 4) with the data's action as the dataset
    policy: ``log sum_a exp Q(s_t, a) - Q(s_t, a_t)``. It pushes down the soft maximum of Q, so
    the high-valued tokens the data never took most, and lifts the taken one; unlike the floor
    term it is invariant to a shift of all of a state's Q values, so it does not fight the level of
    a pretrained model's logits (for a language model it is the cross-entropy of the data tokens).

    Args:
        logsumexp_q: ``(B, T)`` ``log sum_a exp Q(s_t, a)`` over the vocabulary.
        q_taken: ``(B, T)`` Q of the taken actions.
    Returns:
        ``(B, T)`` penalties (>= 0); the caller masks, weights and normalises them.
    """
    return logsumexp_q - q_taken


def value_graded(q_taken: Tensor, logsumexp_q: Tensor | None, weight: float) -> Tensor:
    """``q_taken`` with its values unchanged and the state-value part of its gradient scaled by ``weight``.

    A state's logits are Q up to a common level: ``Q(s, a) = log softmax(Q(s, .))[a] + V(s)`` with
    ``V(s) = log sum_a exp Q(s, a)`` (the dueling decomposition, Wang et al. 2016, with the soft
    value). The gradient of ``Q(s, a)`` in the logits, ``e_a``, splits into ``e_a - p`` (the
    policy's log-prob of ``a``) and ``p`` (``V``, a shift the softmax ignores). ``weight`` 1 keeps
    plain Q-learning; 0 leaves the level to the forward values only, so a squared TD error on the
    result regresses ``log p(a|s)`` on the target less the state's current value (advantage
    learning; at a level of 0 the gradient of Zhu et al. 2023's APA), and a token the policy is sure
    of (``p`` near 1) gets none. Values, and so targets and statistics, are the same for every weight.

    Args:
        q_taken: ``(B, T)`` Q of the taken tokens (calibrated: less a constant, the reference's logit).
        logsumexp_q: ``(B, T)`` ``log sum_a exp Q(s_t, a)`` of the same logits, with gradient; only
            read when ``weight < 1``.
        weight: in [0, 1].
    """
    if weight >= 1:
        return q_taken
    if logsumexp_q is None:
        raise ValueError("value_graded needs the states' logsumexp when weight < 1")
    return q_taken - (1 - weight) * (logsumexp_q - logsumexp_q.detach())


def reference_valued(q_taken: Tensor, logsumexp_q: Tensor, ref_logsumexp: Tensor) -> Tensor:
    """Calibrated Q of the taken tokens with each state's value read as the reference's, 0:
    ``log p(a|s) - log p_ref(a|s)``.

    A calibrated Q is ``Q(s, a) = log p(a|s) - log p_ref(a|s) + V(s)`` with the soft value
    ``V(s) = logsumexp(logits) - logsumexp(logits_ref)``. With ``value_graded`` at 0 no TD error
    trains ``V``, yet every update moves it (the logits share their weights), so each state's TD
    error carries an untrained offset that the log-prob then makes up for. Reading ``V`` as the
    reference's (0) instead makes the squared TD error regress the log-ratio on the target itself:
    with targets centered by their group's mean return (``reward_baseline``), the advantage-induced
    policy alignment loss of Zhu et al. 2023 (APA), ``(log pi/pi_ref - A / lambda)^2`` with
    ``1 / lambda`` the ``reward_scale``, over every token of a multi-turn episode. The gradient is
    the log-prob's alone, ``e_a - p``, as at ``value_graded`` 0; only the value differs.

    Args:
        q_taken: ``(B, T)`` calibrated Q of the taken tokens (the logit less the reference's logit).
        logsumexp_q: ``(B, T)`` ``logsumexp`` of the online logits of the same states, with gradient.
        ref_logsumexp: ``(B, T)`` the reference's ``logsumexp`` of the same states.
    """
    return q_taken - logsumexp_q + ref_logsumexp
