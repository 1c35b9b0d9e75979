"""N data-parallel learners take the same step as one learner on the same global batch.

Ranks are simulated with threads (``tests/helpers/collective.py``) running the learners' real
reduction paths: per-row tensors gathered by summing, global token/sequence normalisers, summed
gradients. Gradients are compared before the optimiser step (captured through
``on_gradients``), never parameters after Adam.
"""

import pytest
import torch

from learners.training.distributed import Collective
from tests.helpers.collective import run_ranks
from tests.helpers.factories import experience, flat_grads, grouped_batch, make_learner, tiny_lm

# Unequal groups (3, 2, 2 samples) and an odd batch of 7: over 2 ranks, groups 10 and 30 (5 rows)
# land on rank 0 and group 20 (2 rows) on rank 1, so the two shards differ in size.
GROUPS = [10, 10, 20, 10, 20, 30, 30]
SCORES = [1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0]
TOL = dict(atol=2e-6, rtol=1e-4)


def _learners(path, train, ppo, world):
    # Built one after another, before the rank threads start: transformers' from_pretrained
    # toggles process-wide state while loading and is not safe to run in two threads at once.
    return [make_learner(path, train=train, ppo=ppo) for _ in range(world)]


def _step(learner, batch, comm):
    learner.comm = comm
    captured = {}
    learner.on_gradients = lambda params: captured.setdefault("g", flat_grads(params))
    metrics = learner.train_step(batch)
    return captured["g"], metrics


def _batch(path, ref_shift=0.05):
    lm = tiny_lm(path)
    ids, att, rm = grouped_batch(lm.config.vocab_size, GROUPS, seed=3)
    return experience(lm, ids, att, rm, SCORES, groups=GROUPS, ref_shift=ref_shift)


def _compare(path, batch, train, ppo, world=2):
    g1, m1 = _step(make_learner(path, train=train, ppo=ppo), batch, Collective())
    learners = _learners(path, train, ppo, world)
    results = run_ranks(world, lambda rank, comm: _step(learners[rank], batch, comm))
    for g, m in results:
        torch.testing.assert_close(g, g1, **TOL)
        for key in ("loss/policy", "policy/grad_norm", "advantage/mean", "kl/ref_k1", "policy/entropy"):
            if key in m1:
                assert m[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    assert g1.abs().sum() > 0  # a real gradient, not two zeros agreeing
    return g1, m1, results


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("estimator", ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_two_learners_match_one_on_the_global_batch(tiny_model_path, estimator, loss_agg):
    batch = _batch(tiny_model_path)
    # micro_batch_size 2: several ragged micro-batches per rank (a separate old-policy pass for the
    # critic / KL, streamed otherwise); kl_coef > 0 puts the gathered old log-probs into the rewards.
    train = {"micro_batch_size": 2}
    ppo = {"advantage_estimator": estimator, "loss_agg": loss_agg, "kl_coef": 0.1}
    _, m1, results = _compare(tiny_model_path, batch, train, ppo)
    # Each rank trained on its own rows only, and together on all of them.
    assert sorted(m["learner/local_sequences"] for _, m in results) == [2.0, 5.0]
    assert m1["learner/sequences"] == 7.0


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_fused_and_streamed_paths_match_across_ranks(tiny_model_path, estimator):
    """The on-policy fast paths also give the one-learner step: fused (one micro-batch holds a
    rank's whole shard) and, without critic or KL, streamed."""
    batch = _batch(tiny_model_path, ref_shift=None)
    for micro, path_key in ((8, "learner/fused_old_pass"), (2, "learner/streamed_old_pass")):
        if estimator == "gae" and micro == 2:
            continue  # a critic needs the old values before the update: no streamed path
        ppo = {"advantage_estimator": estimator, "kl_coef": 0.0}
        _, m1, results = _compare(tiny_model_path, batch, {"micro_batch_size": micro}, ppo)
        assert m1[path_key] == 1.0 and all(m[path_key] == 1.0 for _, m in results)


def test_group_statistics_ignore_the_split(tiny_model_path):
    """The example from the issue: groups of 2 and 3 over 2 ranks, scores [1, 0] in the pair;
    GRPO's advantages in the pair are +-0.71 whatever the split (padding rows used to join)."""
    groups = [1, 1, 2, 2, 2]
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = grouped_batch(lm.config.vocab_size, groups, seed=1)
    batch = experience(lm, ids, att, rm, [1.0, 0.0, 0.0, 1.0, 1.0], groups=groups, ref_shift=None)
    ppo = {"advantage_estimator": "grpo", "kl_coef": 0.0}
    seen = {}
    learners = _learners(tiny_model_path, {}, ppo, 2)

    def step(rank, comm):
        learner = learners[rank]
        learner.comm = comm
        orig = learner._advantages

        def spy(exp, *a, **k):
            adv, ret, kl = orig(exp, *a, **k)
            seen[rank] = adv
            return adv, ret, kl

        learner._advantages = spy
        return learner.train_step(batch)

    run_ranks(2, step)
    for rank in (0, 1):
        row0, row1 = seen[rank][0][rm[0]], seen[rank][1][rm[1]]
        assert torch.allclose(row0, torch.full_like(row0, 0.7071), atol=1e-3)
        assert torch.allclose(row1, torch.full_like(row1, -0.7071), atol=1e-3)


def test_an_empty_shard_does_not_hang_and_changes_nothing(tiny_model_path):
    """3 groups over 4 ranks: rank 3 has no rows, still takes part in every reduction (the
    helper fails on a hang or on unequal numbers of collective calls), and the step is the
    one-learner step."""
    batch = _batch(tiny_model_path)
    _, _, results = _compare(tiny_model_path, batch, {"micro_batch_size": 2}, {"advantage_estimator": "rloo"}, world=4)
    assert sorted(m["learner/local_sequences"] for _, m in results) == [0.0, 2.0, 2.0, 3.0]


def test_whole_batch_statistics_reinforce_pp_and_kl_controller(tiny_model_path):
    """REINFORCE++ whitens over the whole batch and the adaptive KL controller measures the whole
    batch: every rank ends with the one-learner coefficient."""
    batch = _batch(tiny_model_path, ref_shift=0.3)
    ppo = {
        "advantage_estimator": "reinforce_pp",
        "kl_controller": "adaptive",
        "kl_coef": 0.1,
        "kl_target": 0.01,
        "kl_horizon": 100,
    }
    _, m1, results = _compare(tiny_model_path, batch, {"micro_batch_size": 2}, ppo)
    assert m1["kl/coef_next"] != m1["kl/coef"]
    assert all(m["kl/coef_next"] == pytest.approx(m1["kl/coef_next"], rel=1e-9) for _, m in results)


def test_two_learners_skipping_zero_advantage_rows_match_one_running_them(tiny_model_path):
    """Group 30 scores (0, 0): its rows have advantage 0 and no gradient. Two ranks that skip them
    share the other groups (one each) and take the step of one learner that runs every row."""
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = grouped_batch(lm.config.vocab_size, GROUPS, seed=3)
    scores = [1.0, 0.0, 1.0, 0.2, 0.0, 0.0, 0.0]
    batch = experience(lm, ids, att, rm, scores, groups=GROUPS, ref_shift=None)
    for micro in (8, 2):  # fused and streamed
        train = {"micro_batch_size": micro}
        ppo = {"advantage_estimator": "grpo", "kl_coef": 0.0}
        g1, m1 = _step(
            make_learner(tiny_model_path, train=train, ppo={**ppo, "skip_zero_advantage": False}), batch, Collective()
        )
        assert "learner/zero_advantage_rows" not in m1 and g1.abs().sum() > 0
        learners = _learners(tiny_model_path, train, ppo, 2)
        results = run_ranks(2, lambda rank, comm: _step(learners[rank], batch, comm))
        assert sorted(m["learner/local_sequences"] for _, m in results) == [2.0, 3.0]
        for g, m in results:
            assert m["learner/zero_advantage_rows"] == 2.0
            torch.testing.assert_close(g, g1, **TOL)
            for key in ("loss/policy", "policy/grad_norm", "advantage/mean"):
                assert m[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key


def test_two_learners_with_no_row_to_run_take_part_in_every_reduction(tiny_model_path):
    """Every group scored evenly: neither rank runs a pass, both still make the same collective
    calls (the helper fails on a hang or unequal counts) and step with zero gradients."""
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = grouped_batch(lm.config.vocab_size, GROUPS, seed=3)
    batch = experience(lm, ids, att, rm, [0.3, 0.3, 1.0, 0.3, 1.0, 0.0, 0.0], groups=GROUPS, ref_shift=None)
    ppo = {"advantage_estimator": "grpo", "kl_coef": 0.0}
    learners = _learners(tiny_model_path, {"micro_batch_size": 2}, ppo, 2)
    results = run_ranks(2, lambda rank, comm: _step(learners[rank], batch, comm))
    for g, m in results:
        assert m["learner/zero_advantage_rows"] == 7.0 and m["learner/local_sequences"] == 0.0
        assert g.abs().sum() == 0 and m["loss/policy"] == 0.0


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo"])
def test_two_learners_match_one_with_each_policy_objective(tiny_model_path, policy_loss):
    """GSPO's ratio is per sequence and CISPO's weights per token: either way the ranks' shares of
    the global minibatch add up to the one-learner step. A ratio away from 1 (the reference
    shift is the old policy's offset, clip ranges that bind) exercises the clipping."""
    batch = _batch(tiny_model_path)
    ppo = {
        "advantage_estimator": "grpo",
        "policy_loss": policy_loss,
        "kl_coef": 0.0,
        "clip_eps": 0.01,
        "clip_eps_high": 0.02,
        "loss_agg": "seq_mean_token_mean",
    }
    _compare(tiny_model_path, batch, {"micro_batch_size": 2, "epochs": 2}, ppo)


def _moved_reference(learner):
    """The learner's frozen copy, moved off the initial weights by the same seeded noise on every
    learner, so that the KL term has a gradient in the first update (one the ranks compare
    before Adam turns rounding into sign flips)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in learner._frozen_reference().parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return learner


@pytest.mark.parametrize("micro_batch_size", [2, 8])  # streamed old log-probs; one fused pass
def test_two_learners_match_one_with_the_full_kl_loss(tiny_model_path, micro_batch_size):
    """The exact KL over the vocabulary as the KL loss, to the learners' own frozen copy: each rank
    runs the copy over its own rows, and the ranks' terms add up to the one-learner gradient."""
    batch = _batch(tiny_model_path, ref_shift=None)
    train = {"micro_batch_size": micro_batch_size, "reference": "learners"}
    ppo = {"advantage_estimator": "grpo", "kl_coef": 0.0, "kl_loss_coef": 0.7, "kl_loss_estimator": "full"}
    one = _moved_reference(make_learner(tiny_model_path, train=train, ppo=ppo))
    g1, m1 = _step(one, batch, Collective())
    # Loaded here, not at first use in two threads at once (see _learners).
    learners = [_moved_reference(learner) for learner in _learners(tiny_model_path, train, ppo, 2)]
    for g, m in run_ranks(2, lambda rank, comm: _step(learners[rank], batch, comm)):
        torch.testing.assert_close(g, g1, **TOL)
        assert m["kl/loss_term"] == pytest.approx(m1["kl/loss_term"], rel=1e-4, abs=1e-7)
    assert m1["kl/loss_term"] > 1e-3
    assert m1["learner/fused_old_pass" if micro_batch_size == 8 else "learner/streamed_old_pass"] == 1.0


@pytest.mark.parametrize("world", [2, 4])
def test_minibatch_epochs_cut_the_global_batch(tiny_model_path, world):
    """Two epochs of two minibatches, the critic and a KL term: every minibatch is cut from the
    global batch's rows by a shuffle of (seed, version, epoch), each rank training its own rows of
    it, so N learners take each of the 4 updates one learner takes (each rank used to shuffle its
    own rows, and the minibatches depended on the number of ranks)."""
    batch = _batch(tiny_model_path)
    train = {"micro_batch_size": 2, "epochs": 2, "num_minibatches": 2}
    ppo = {"advantage_estimator": "gae", "kl_coef": 0.1}

    def every_update(learner, comm):
        learner.comm = comm
        grads: list = []
        learner.on_gradients = lambda params: grads.append(flat_grads(params))
        return grads, learner.train_step(batch)

    g1, m1 = every_update(make_learner(tiny_model_path, train=train, ppo=ppo), Collective())
    learners = _learners(tiny_model_path, train, ppo, world)
    for grads, m in run_ranks(world, lambda rank, comm: every_update(learners[rank], comm)):
        assert len(grads) == len(g1) == 4
        for g, ref in zip(grads, g1):
            torch.testing.assert_close(g, ref, **TOL)
        assert m["loss/policy"] == pytest.approx(m1["loss/policy"], rel=1e-4, abs=1e-6)
