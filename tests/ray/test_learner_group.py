"""The real Ray Train learner group: two workers (gloo) on a batch take the same step as one (the
two under real-time scheduling, cluster.realtime_learners): the same losses and gradient norm,
both ranks' weights identical after the step, and equal to the one worker's, for each estimator
family (a critic, group baselines, a whole-batch baseline). With the critic the two workers are
sharded (train.sharding=fsdp). The one worker is the same learner built as a Ray Train worker
builds it (cluster/roles/learner_worker.py), run in this process: a one-worker group would only add a
Ray Train start per case."""

import pytest
import ray
import torch

from cluster.roles import realtime
from cluster.config.role_settings import KEEP_FREED_MEMORY_ENV
from cluster.config.loading import load_config
from cluster.roles.learner_group import LearnerGroup
from cluster.roles.learner_spec import learner_spec
from tests.helpers.factories import experience, grouped_batch, tiny_lm

pytestmark = pytest.mark.ray

GROUPS = [10, 10, 20, 10, 20, 30, 30]


def _learn(cfg, model_path, batch_ref, storage):
    group = LearnerGroup(learner_spec(cfg, model_path, pad_token_id=0), storage)
    try:
        info = group.wait_ready()
        # (Fetched while the workers live: they own what they put in the object store.)
        start = ray.get(group.weights_digest()["trainable"][0])
        result = group.learn(1, [batch_ref])
        after = group.weights_digest()
        end = ray.get(after["trainable"][0])
    finally:
        group.stop()
    return info, result, start, end, after["rank_spread"]


def _learn_here(cfg, model_path, batch):
    """One worker's step in this process: the learner ``learner_loop`` builds from the same spec
    (``build_learner``: the worker's thread count), with the single-process collective."""
    from cluster.roles.learner_worker import build_learner, trainable_flat
    from learners.training.distributed import default_collective

    threads = torch.get_num_threads()
    try:
        learner = build_learner(learner_spec(cfg, model_path, pad_token_id=0), default_collective())
        start = trainable_flat(learner).float()
        metrics = learner.train_step(batch)
        return metrics, start, trainable_flat(learner).float()
    finally:
        torch.set_num_threads(threads)


# gae: a critic and a KL term, every row runs. grpo without KL: the row whose score is its group's
# mean (row 3: 0.5 in group 10's 1, 0, 0.5) has advantage 0 and no gradient; the two workers skip
# it (ppo.skip_zero_advantage) while the one worker runs it, and the step is the same.
# Every estimator x split: tests/unit/test_multi_learner.py.
# reinforce_pp: its baseline is the whole batch's mean, which two ranks must agree on.
@pytest.mark.parametrize("estimator", ["gae", "grpo", "reinforce_pp"])
def test_two_ray_train_workers_match_one(ray_cluster, tiny_model_path, tmp_path, estimator):
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = grouped_batch(lm.config.vocab_size, GROUPS, seed=3)
    kl = 0.1 if estimator == "gae" else 0.0
    batch = experience(
        lm, ids, att, rm, [1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0], groups=GROUPS, ref_shift=0.05 if kl else None
    )
    ref = ray.put(batch)
    out, weights = {}, {}
    # With a critic and a KL term (the most passes) the two workers are sharded (FSDP2); the other
    # estimators' two workers are replicated (two replicated ranks with a critic: test_multi_learner.py).
    runs = [(1, "replicated"), (2, "fsdp" if estimator == "gae" else "replicated")]
    for n, sharding in runs:
        cfg = load_config(
            overrides=[
                f"model.path={tiny_model_path}",
                "train.bf16=false",
                "train.micro_batch_size=2",
                "model.generator_dtype=float32",
                f"ppo.advantage_estimator={estimator}",
                f"ppo.kl_coef={kl}",
                "rollout.samples_per_prompt=2",
                "train.epochs=1",
                "train.num_minibatches=1",
                f"ppo.skip_zero_advantage={n == 2}",
                f"cluster.num_learners={n}",
                "cluster.cpus_per_learner=1",
                "cluster.threads=1",
                # The two-worker update runs under real-time scheduling: the same maths, only sooner.
                f"cluster.realtime_learners={n == 2}",
                f"train.sharding={sharding}",
            ]
        )
        if n == 1:
            out[1], start, end = _learn_here(cfg, tiny_model_path, ray.get(ref))
            weights[1] = (start, end)
            continue
        info, result, start, end, spread = _learn(cfg, tiny_model_path, ref, tmp_path / f"n{n}{sharding}")
        assert info["world"] == n
        assert spread == 0.0  # every rank holds the same weights after the step (sharded: no copies)
        weights[n] = (start, end)
        # CPU workers start with glibc's keep-freed-memory settings (cluster.keep_freed_memory).
        assert {k: info["env"][k] for k in KEEP_FREED_MEMORY_ENV} == KEEP_FREED_MEMORY_ENV
        out[n] = result["metrics"]
    one, two = out[1], out[2]
    assert "learner/realtime" not in one
    assert two["learner/realtime"] == float(realtime.throttled() and realtime.permitted())
    assert one["learner/local_sequences"] == 7.0 and "learner/zero_advantage_rows" not in one
    if estimator == "gae":
        assert two["learner/local_sequences"] == 5.0  # rank 0 of 2: groups 10 and 30
        assert "learner/zero_advantage_rows" not in two  # a critic: skipping does not apply
    elif estimator == "grpo":
        assert two["learner/local_sequences"] == 4.0  # rank 0 of 2: groups 10 (less row 3) and 30
        assert two["learner/zero_advantage_rows"] == 1.0
    for key in ("policy/grad_norm", "loss/policy", "loss/total", "advantage/mean") + (("kl/ref_k1",) if kl else ()):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    assert one["policy/grad_norm"] > 0
    # The same start, the same step: two workers' weights equal one worker's, and they moved.
    (start1, end1), (start2, end2) = weights[1], weights[2]
    assert torch.equal(start1, start2) and not torch.allclose(start1, end1)
    # (AdamW's first step moves each weight by about lr = 1e-6 in the sign of its gradient: 0.2 lr
    # apart at most, with no relative slack, tells a wrong direction anywhere. The sharded
    # workers' weights are gathered from their shards.)
    torch.testing.assert_close(end2 - start2, end1 - start1, rtol=0, atol=2e-7)
