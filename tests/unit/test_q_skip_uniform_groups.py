"""``qlearn.skip_uniform_groups``: a Q learner with a per-group baseline leaves out the groups whose
centered rewards are all 0 (every sample earned the same, reward for reward). By hand: which
groups carry a signal (equal returns earned at other turns do; equal floats that a mean misses by
an ulp do not); the learner's gradient on a batch with such a group equals a plain learner's on
the batch without it (and differs from the plain learner's on the whole batch); a batch of uniform
groups alone makes no update; ranks keep a group any of them keeps; the config refuses the filter without groups."""

import pytest
import torch

from cluster.config import ConfigError
from cluster.config.loading import load_config
from learners.training.distributed import Collective
from learners.objectives.reward_shaping import centered_returns, groups_with_signal
from tests.helpers.factories import make_q_learner, step_with_grads, transitions_batch

HP = {
    "calibration": "reference",
    "conservative": "logsumexp",
    "conservative_weight": 1.0,
    "value_grad": 0.0,
    "reward_baseline": "group_mean",
    "reward_scale": 5.0,
    "n_step": 8,
    "mc_lower_bound": True,
}
TRAIN = {"epochs": 1, "num_minibatches": 1, "lr": 1e-2, "reference": "learners", "shared_prefix": False}

# Prompt 5 6 7; tokens A=10, B=11, C=12, EOS=2. Group 0: a solved and a failed episode (signal).
# Group 1: both solved at their last token (uniform). Group 2: both earn 1, one at its second
# token of three, one at its last (signal: the targets of the first's later tokens differ).
EPISODES = [
    ([10, 12, 2], [0, 0, 1.0]),
    ([10, 2], [0, 0.0]),
    ([11, 2], [0, 1.0]),
    ([12, 10, 2], [0, 0, 1.0]),
    ([11, 12, 2], [0, 1.0, 0]),
    ([10, 2], [0, 1.0]),
]
GROUPS = [0, 0, 1, 1, 2, 2]


def _batch(rows=None):
    batch = transitions_batch([5, 6, 7], EPISODES)
    batch = batch.replace(group_ids=torch.tensor(GROUPS))
    return batch if rows is None else batch.select(rows)


def _signal(rewards, mask, groups):
    return groups_with_signal(centered_returns(rewards, mask, groups), mask, groups).tolist()


def test_which_groups_carry_a_signal_by_hand():
    batch = _batch()
    rewards, mask = batch.token_rewards, batch.response_mask
    assert _signal(rewards, mask, batch.group_ids) == [True, True, False, False, True, True]
    # A baseline that misses equal floats by an ulp: three rows scoring 0.1 x 20 each, whose mean
    # is not exactly 2 in float32, are still one uniform group.
    r = torch.zeros(3, 4)
    r[:, 3] = torch.tensor(0.1, dtype=torch.float32) * 20
    m = torch.zeros(3, 4, dtype=torch.bool)
    m[:, 1:] = True
    assert _signal(r, m, torch.tensor([7, 7, 7])) == [False, False, False]
    # One group of a batch: every row answers for its group, whatever the order of the ids.
    assert _signal(r * torch.tensor([[1.0], [0.0], [1.0]]), m, torch.tensor([3, 9, 3])) == [False, False, False]
    assert _signal(r * torch.tensor([[1.0], [0.0], [1.0]]), m, torch.tensor([3, 3, 9])) == [True, True, False]
    # A reward outside the actions (a row without actions) counts for nothing.
    assert _signal(r, torch.zeros_like(m), torch.tensor([0, 0, 1])) == [False, False, False]


def test_the_gradient_is_the_plain_learners_on_the_groups_with_a_signal(tiny_model_path):
    skipping = make_q_learner(tiny_model_path, train=TRAIN, qlearn={**HP, "skip_uniform_groups": True})
    plain = make_q_learner(tiny_model_path, train=TRAIN, qlearn=HP)
    got, metrics = step_with_grads(skipping, _batch())
    want, want_metrics = step_with_grads(plain, _batch([0, 1, 4, 5]))
    torch.testing.assert_close(got["g"], want["g"], atol=1e-6, rtol=1e-5)
    assert metrics["learner/uniform_group_rows"] == 2.0 and metrics["learner/sequences"] == 4.0
    assert metrics["loss/td"] == pytest.approx(want_metrics["loss/td"], abs=1e-6)
    whole, _ = step_with_grads(make_q_learner(tiny_model_path, train=TRAIN, qlearn=HP), _batch())
    assert (whole["g"] - want["g"]).abs().max() > 1e-4  # the uniform group's rows do move Q


def test_a_batch_of_uniform_groups_makes_no_update(tiny_model_path):
    learner = make_q_learner(tiny_model_path, train=TRAIN, qlearn={**HP, "skip_uniform_groups": True})
    before = [p.detach().clone() for p in learner.model.parameters()]
    metrics = learner.train_step(_batch([2, 3]))
    assert metrics["learner/empty_batch"] == 1.0 and metrics["learner/uniform_group_rows"] == 2.0
    assert all(torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))
    assert learner.version == 0 and learner.updates == 0
    # Held-out evaluation reads every row, the uniform ones included.
    assert learner.evaluate(_batch([2, 3]))["eval/q/target"] == pytest.approx(0.0, abs=1e-6)


class _PeerKeepsAll(Collective):
    """A single rank whose peers' maximum is 1 everywhere: another rank saw a signal in every row."""

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(t)


def test_ranks_keep_a_group_any_of_them_keeps(tiny_model_path):
    """Sharded ranks must pass the same rows: a group another rank keeps (a centered reward it did
    not round to 0) is kept here too, so the uniform group trains as in a plain learner."""
    learner = make_q_learner(
        tiny_model_path, train=TRAIN, qlearn={**HP, "skip_uniform_groups": True}, comm=_PeerKeepsAll()
    )
    got, metrics = step_with_grads(learner, _batch())
    want, _ = step_with_grads(make_q_learner(tiny_model_path, train=TRAIN, qlearn=HP), _batch())
    assert metrics["learner/uniform_group_rows"] == 0.0 and metrics["learner/sequences"] == 6.0
    torch.testing.assert_close(got["g"], want["g"], atol=1e-6, rtol=1e-5)


def test_the_config_refuses_the_filter_without_groups():
    base = ["run.algorithm=qlearn", "qlearn.skip_uniform_groups=true"]
    with pytest.raises(ConfigError, match="reward_baseline=group_mean"):
        load_config(None, base)
    with pytest.raises(ConfigError, match="reward_baseline=group_mean"):
        load_config(None, base + ["qlearn.reward_baseline=batch_mean"])
    load_config(None, base + ["qlearn.reward_baseline=group_mean"])
