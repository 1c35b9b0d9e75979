"""The DPO learner: pairs from groups, the loss at the reference, gradients invariant to the
data-parallel split, micro-batching and the shared-prefix path, learning, LoRA and resume."""

import math

import pytest
import torch

from learners.dpo import preference_pairs
from learners.experience import ExperienceError
from tests.helpers.collective import run_ranks
from tests.helpers.factories import flat_grads, make_dpo_learner, preference_batch, tiny_lm

TOL = dict(atol=2e-6, rtol=1e-4)


def _step(learner, batch, comm=None):
    if comm is not None:
        learner.comm = comm
    captured = {}
    learner.on_gradients = lambda params: captured.setdefault("g", flat_grads(params))
    metrics = learner.train_step(batch)
    return captured["g"], metrics


def test_pairs_from_groups_count_malformed_ones():
    groups = torch.tensor([7, 7, 3, 3, 3, 9, 5, 5, 4, 4])
    scores = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.5, 1.0, 0.5, 0.5, 2.0, -1.0])
    chosen, rejected, bad = preference_pairs(groups, scores)
    assert chosen.tolist() == [1, 8] and rejected.tolist() == [0, 9]
    assert bad == 3  # a group of three, a single row, a tie


def test_at_the_reference_the_loss_is_log2(tiny_model_path):
    """Policy = reference: every implicit reward is 0, so sigmoid DPO's loss is -log sigma(0)."""
    batch = preference_batch(tiny_lm(tiny_model_path), 5, ref_shift=0.0)
    g, m = _step(make_dpo_learner(tiny_model_path), batch)
    assert m["loss/total"] == pytest.approx(math.log(2), abs=1e-5)
    assert m["rewards/margin"] == pytest.approx(0.0, abs=1e-5)
    assert m["learner/pairs"] == 5 and m["learner/malformed_pairs"] == 0
    assert g.abs().sum() > 0


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo"])
def test_two_learners_match_one(tiny_model_path, loss):
    # 5 pairs over 2 ranks and 2 minibatches: shards of 2 and 1 pairs (and 1 and 1).
    batch = preference_batch(tiny_lm(tiny_model_path), 5, seed=1, ref_shift=0.1)
    train = {"micro_batch_size": 2, "num_minibatches": 2}
    dpo = {"loss": loss, "beta": 0.5}
    g1, m1 = _step(make_dpo_learner(tiny_model_path, train=train, dpo=dpo), batch)
    learners = [make_dpo_learner(tiny_model_path, train=train, dpo=dpo) for _ in range(2)]
    results = run_ranks(2, lambda rank, comm: _step(learners[rank], batch, comm))
    for g, m in results:
        torch.testing.assert_close(g, g1, **TOL)
        for key in ("loss/total", "rewards/margin", "rewards/chosen", "logps/rejected", "policy/grad_norm"):
            assert m[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    assert sorted(m["learner/local_pairs"] for _, m in results) == [2.0, 3.0]
    assert g1.abs().sum() > 0


def test_micro_batching_and_shared_prefix_do_not_change_the_gradient(tiny_model_path):
    batch = preference_batch(tiny_lm(tiny_model_path), 4, seed=2, ref_shift=0.05)
    grads = {}
    for mbs, shared in ((8, False), (2, False), (8, True), (2, True)):
        g, m = _step(make_dpo_learner(tiny_model_path, train={"micro_batch_size": mbs, "shared_prefix": shared}), batch)
        grads[(mbs, shared)] = g
        assert m["learner/prefix_shared_frac"] == (1.0 if shared else 0.0)
    ref = grads[(8, False)]
    for key, g in grads.items():
        torch.testing.assert_close(g, ref, **TOL, msg=str(key))


def test_malformed_pairs_are_counted_and_left_out(tiny_model_path):
    lm = tiny_lm(tiny_model_path)
    good = preference_batch(lm, 3, seed=4)
    assert good.scores.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    tied = good.replace(scores=torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0]))  # pair 1 tied
    g_good, _ = _step(make_dpo_learner(tiny_model_path), good.select([0, 1, 4, 5]))
    g_tied, m = _step(make_dpo_learner(tiny_model_path), tied)
    assert m["learner/pairs"] == 2 and m["learner/malformed_pairs"] == 1
    torch.testing.assert_close(g_tied, g_good, **TOL)
    none = make_dpo_learner(tiny_model_path).train_step(good.replace(scores=torch.ones(6)))
    assert none["learner/empty_batch"] == 1.0 and none["learner/malformed_pairs"] == 3


def test_reference_is_required_except_for_simpo(tiny_model_path):
    batch = preference_batch(tiny_lm(tiny_model_path), 2, ref_shift=None)
    with pytest.raises(ExperienceError, match="ref_logprobs"):
        make_dpo_learner(tiny_model_path).train_step(batch)
    m = make_dpo_learner(tiny_model_path, dpo={"loss": "simpo", "beta": 2.0}).train_step(batch)
    assert math.isfinite(m["loss/total"]) and m["loss/total"] > 0


def test_dpo_learns_the_preferences(tiny_model_path):
    """Repeated steps on a fixed preference set: loss falls below log 2, every pair's implicit
    reward ranks chosen over rejected, the margin grows."""
    batch = preference_batch(tiny_lm(tiny_model_path), 6, seed=5)
    learner = make_dpo_learner(tiny_model_path, train={"lr": 3e-3, "micro_batch_size": 4}, dpo={"beta": 0.5})
    before = learner.evaluate(batch)
    assert before["eval/loss/total"] == pytest.approx(math.log(2), abs=1e-5) and before["eval/pairs"] == 6
    history = [learner.train_step(batch) for _ in range(8)]
    after = learner.evaluate(batch)
    assert after["eval/loss/total"] < 0.5 * math.log(2)
    assert after["eval/rewards/accuracy"] == 1.0 and after["eval/rewards/margin"] > before["eval/rewards/margin"] + 1.0
    first, last = history[0], history[-1]
    assert first["loss/total"] == pytest.approx(math.log(2), abs=1e-5)
    assert last["loss/total"] < 0.5 * first["loss/total"], [h["loss/total"] for h in history]
    assert last["rewards/accuracy"] == 1.0 and last["rewards/margin"] > 1.0
    assert learner.version == 8


def test_lora_dpo_computes_its_reference_with_the_adapter_off(tiny_model_path):
    """No ref_logprobs in the batch: the learner scores the base model itself. At the start the
    adapter is a no-op (LoRA B = 0), so the loss is exactly the reference's log 2."""
    batch = preference_batch(tiny_lm(tiny_model_path), 3, ref_shift=None)
    learner = make_dpo_learner(
        tiny_model_path, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}, train={"lr": 1e-2}
    )
    g, m = _step(learner, batch)
    assert m["loss/total"] == pytest.approx(math.log(2), abs=1e-5)
    assert 0 < learner.trainable_fraction < 0.5 and g.abs().sum() > 0
    m2 = learner.train_step(batch)
    assert m2["loss/total"] < m["loss/total"]  # the adapter moved; the reference did not


def test_dpo_resumes_exactly(tiny_model_path, tmp_path):
    batch = preference_batch(tiny_lm(tiny_model_path), 4, seed=6, ref_shift=0.05)
    train = {"lr": 1e-3, "num_minibatches": 2, "micro_batch_size": 2, "lr_schedule": "cosine", "warmup_steps": 1}
    straight = make_dpo_learner(tiny_model_path, train=train)
    for _ in range(2):
        straight.train_step(batch)
    straight.save(tmp_path / "ckpt", tokenizer_from=tiny_model_path)
    g_a, m_a = _step(straight, batch)
    resumed = make_dpo_learner(tiny_model_path, train=train)
    resumed.restore(tmp_path / "ckpt")
    assert resumed.version == 2
    g_b, m_b = _step(resumed, batch)
    torch.testing.assert_close(g_b, g_a, atol=1e-6, rtol=1e-5)
    assert m_b["learner/lr"] == m_a["learner/lr"]
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    assert not list((tmp_path / "ckpt").glob("critic"))  # no value head in a DPO checkpoint
    from learners.base import load_learner_state

    assert load_learner_state(tmp_path / "ckpt")["algorithm"] == "dpo"
    with pytest.raises(ValueError, match="dpo learner"):
        from tests.helpers.factories import make_learner

        make_learner(tiny_model_path).load_state_dict(load_learner_state(tmp_path / "ckpt"))


def test_registry_and_config_know_dpo():
    from cluster.config.loading import load_config
    from learners.base import get_learner
    from learners.dpo import DPOLearner

    assert get_learner("dpo") is DPOLearner
    cfg = load_config(overrides=["dpo.loss=ipo", "dpo.beta=0.3"])
    assert cfg.dpo.loss == "ipo" and cfg.dpo.uses_reference
    assert not load_config(overrides=["dpo.loss=simpo"]).dpo.uses_reference
    with pytest.raises(Exception, match="dpo.loss"):
        load_config(overrides=["dpo.loss=kto"])
