"""Reward centering for Q-learning (``qlearn.reward_baseline=batch_mean | group_mean``,
``learners.objectives.reward_shaping.centered_returns``): the batch's mean return comes off each sequence's
terminal reward (or the mean of its group's). By hand and against a naive loop; the soft-optimal policy of a token tree is the
same with and without it (the claim that makes it safe); the learner's targets are the centered
returns and a failed sequence's actions fall below the prior's Q of 0."""

import itertools

import pytest
import torch

from learners.objectives.reward_shaping import centered_returns, per_group_sum
from tests.helpers.factories import make_q_learner, transitions_batch


def test_centered_returns_by_hand():
    # Row 0 solved (1.0 at its last action), row 1 a two-turn episode (actions 0, 1, 3: the gap is
    # an observation) that failed, row 2 without actions: the mean over rows with actions is 0.5.
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1], [0, 0, 0, 0]]).bool()
    want = torch.tensor([[0.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, -0.5], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(centered_returns(r, m), want)
    torch.testing.assert_close(centered_returns(r, torch.zeros_like(m)), r)  # no actions: unchanged


def test_per_group_sums_match_a_naive_loop():
    ids = torch.tensor([7, -2, 7, 40, -2, 7])  # any ids, not 0..G-1
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    want = torch.tensor([sum(float(values[j]) for j in range(6) if ids[j] == ids[i]) for i in range(6)])
    torch.testing.assert_close(per_group_sum(values, ids), want)
    assert per_group_sum(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_centered_returns_match_a_naive_loop():
    g = torch.Generator().manual_seed(3)
    r = torch.randn(6, 9, generator=g, dtype=torch.float64)
    m = torch.rand(6, 9, generator=g) < 0.6
    m[4] = False
    got = centered_returns(r, m)
    rows = [b for b in range(6) if m[b].any()]
    mean = sum(float(sum(r[b, t] for t in range(9) if m[b, t])) for b in rows) / len(rows)
    want = r.clone()
    for b in rows:
        last = max(t for t in range(9) if m[b, t])
        want[b, last] -= mean
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want)
    # The returns now average 0 over the rows with actions.
    assert float(torch.where(m, got, 0.0).sum(1)[rows].mean()) == pytest.approx(0.0, abs=1e-12)


def test_group_centered_returns_by_hand_and_against_a_naive_loop():
    # Groups 7 (rows 0, 1: returns 1, 0) and 3 (rows 2, 3: 0, 1); row 4 alone in group 9.
    r = torch.tensor([[0, 0, 1.0], [0, 0, 0], [0, 0, 0], [0, 0, 1.0], [0, 0.5, 0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]]).bool()
    want = torch.tensor([[0, 0, 0.5], [0, -0.5, 0], [-0.5, 0, 0], [0, 0, 0.5], [0, 0.5, -0.5]])
    torch.testing.assert_close(centered_returns(r, m, torch.tensor([7, 7, 3, 3, 9])), want)
    g = torch.Generator().manual_seed(5)
    r = torch.randn(10, 7, generator=g, dtype=torch.float64)
    m = torch.rand(10, 7, generator=g) < 0.6
    m[3] = False
    groups = torch.randint(0, 4, (10,), generator=g)
    want = r.clone()
    for b in range(10):
        if not m[b].any():
            continue
        mates = [k for k in range(10) if groups[k] == groups[b] and m[k].any()]
        mean = sum(float(r[k][m[k]].sum()) for k in mates) / len(mates)
        want[b, max(t for t in range(7) if m[b, t])] -= mean
    torch.testing.assert_close(centered_returns(r, m, groups), want)


def _soft_optimal_policy(rewards: dict, prior: torch.Tensor, vocab: int, depth: int) -> dict:
    """pi*(a|s) = pi0(a|s) exp(Q(s, a) - V(s)) of a depth-``depth`` token tree (deterministic
    transitions, reward at the leaves, gamma 1) by backward recursion:
    Q(s, a) = V(s + a), V(leaf) = r, V(s) = log sum_a pi0(a|s) exp Q(s, a)."""
    value = dict(rewards)
    policy = {}
    for d in range(depth - 1, -1, -1):
        for s in itertools.product(range(vocab), repeat=d):
            q = torch.tensor([value[s + (a,)] for a in range(vocab)], dtype=torch.float64)
            value[s] = float(torch.logsumexp(q + prior[d].log(), 0))
            policy[s] = prior[d] * torch.exp(q - value[s])
    return policy


def test_a_constant_off_every_terminal_reward_leaves_the_soft_optimal_policy_unchanged():
    g = torch.Generator().manual_seed(0)
    vocab, depth = 3, 3
    prior = torch.softmax(torch.randn(depth, vocab, generator=g, dtype=torch.float64), -1)
    leaves = {s: float(torch.rand((), generator=g) < 0.3) * 20.0 for s in itertools.product(range(vocab), repeat=depth)}
    mean = sum(leaves.values()) / len(leaves)
    plain = _soft_optimal_policy(leaves, prior, vocab, depth)
    centered = _soft_optimal_policy({s: r - mean for s, r in leaves.items()}, prior, vocab, depth)
    for s in plain:
        torch.testing.assert_close(centered[s], plain[s])
    assert any((plain[s] - prior[len(s)]).abs().max() > 0.1 for s in plain)  # the rewards do tilt it


def _row_q(q, batch, ref) -> list[float]:
    """Mean calibrated Q (online logit - reference logit of the taken token) of each row's actions."""
    with torch.no_grad():
        online = q.model.lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits.float()
    mask, _, _ = q.episodes(batch)
    rows = []
    for i in range(batch.batch_size):
        ts = mask[i].nonzero().squeeze(1).tolist()
        a = batch.input_ids[i]
        rows.append(sum(float(online[i, t - 1, a[t]] - ref[i, t - 1, a[t]]) for t in ts) / len(ts))
    return rows


def test_the_calibrated_learner_backs_up_centered_returns(tiny_model_path):
    """Monte-Carlo targets (n_step past the episode): at the start Q = 0 and each action's target is
    its sequence's centered return; trained, the failed sequences' actions sit below 0 and the
    solved one's above. Without centering the failed ones' target is the 0 they start at."""
    batch = transitions_batch([5, 6, 7], [([10, 12, 2], [0, 0, 1.0]), ([11, 2], [0, 0]), ([12, 13, 2], [0, 0, 0])])
    hp = {
        "calibration": "reference",
        "conservative": "logsumexp",
        "conservative_weight": 0.0,
        "n_step": 8,
        "mc_lower_bound": False,
    }
    train = {"lr": 1e-3, "reference": "learners", "shared_prefix": False}
    ref = None
    results = {}
    for baseline in ("batch_mean", "none"):
        q = make_q_learner(tiny_model_path, train=train, qlearn={**hp, "reward_baseline": baseline})
        if ref is None:
            with torch.no_grad():
                ref = q.model.lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits.float()
        start = q.evaluate(batch)
        assert start["eval/q/taken"] == pytest.approx(0.0, abs=1e-5)
        for _ in range(30):
            q.train_step(batch)
        results[baseline] = (start, _row_q(q, batch, ref))
        _, rewards, _ = q.episodes(batch)
        assert float(rewards.sum()) == pytest.approx(1.0)  # what episodes reports stays uncentered
    # Returns 1, 0, 0: mean 1/3; targets 2/3 on 3 actions, -1/3 on 2 + 3 actions.
    assert results["batch_mean"][0]["eval/q/target"] == pytest.approx((3 * 2 / 3 - 5 / 3) / 8, abs=1e-5)
    assert results["none"][0]["eval/q/target"] == pytest.approx(3 / 8, abs=1e-5)
    solved, *failed = results["batch_mean"][1]
    assert solved == pytest.approx(2 / 3, abs=0.1) and all(f == pytest.approx(-1 / 3, abs=0.1) for f in failed)
    solved, *failed = results["none"][1]
    assert solved == pytest.approx(1.0, abs=0.1) and all(f == pytest.approx(0.0, abs=0.1) for f in failed)
    # Per prompt: rows 0 and 1 share one (returns 1, 0: targets 1/2 on 3 actions, -1/2 on 2), row 2
    # is alone (its own mean: 0 on 3 actions).
    q = make_q_learner(tiny_model_path, train=train, qlearn={**hp, "reward_baseline": "group_mean"})
    grouped = q.evaluate(batch.replace(group_ids=torch.tensor([4, 4, 9])))
    assert grouped["eval/q/target"] == pytest.approx((3 / 2 - 2 / 2) / 8, abs=1e-5)
