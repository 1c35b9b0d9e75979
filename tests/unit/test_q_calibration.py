"""Calibrated Q (``qlearn.calibration=reference``): Q = logits - the frozen initial model's log sum
exp in the same state. At the start Q is that model's log-probabilities and the targets its best
next log-probability (checked against a full forward pass by hand); trained, the calibrated Q
satisfies the Bellman equation of a token MDP on the reward scale; N learners take one learner's step; the config
refuses what cannot work."""

import pytest
import torch

from cluster.config import ConfigError
from cluster.config_loading import load_config
from learners.modeling import state_logsumexp
from tests.helpers.collective import run_ranks
from tests.helpers.factories import make_q_learner, ragged_batch, step_with_grads, tiny_lm, transitions_batch

CALIBRATED = {"calibration": "reference", "conservative": "logsumexp"}
OWN_REFERENCE = {"reference": "learners", "shared_prefix": False}


def _mdp_batch():
    # Prompt 5 6 7; tokens A=10, B=11, C=12, EOS=2 (the tiny model's eos_token_id).
    return transitions_batch([5, 6, 7], [([10, 12, 2], [0, 0, 1.0]), ([10, 2], [0, 0.3]), ([11, 2], [0.1, 0.5])])


def _full_logits(lm, ids, att) -> torch.Tensor:
    with torch.no_grad():
        return lm(input_ids=ids, attention_mask=att.long()).logits.float()


def test_state_logsumexp_equals_the_full_logits_log_normaliser(tiny_model_path):
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = ragged_batch(lm.config.vocab_size, b=5)
    states = rm & (torch.rand(rm.shape, generator=torch.Generator().manual_seed(1)) < 0.7)
    got = state_logsumexp(lm, ids, att, states, micro_batch_size=2, chunk=3)
    want = torch.where(states, torch.logsumexp(_full_logits(lm, ids, att), -1), torch.zeros(()))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_calibrated_q_starts_at_the_initial_models_log_probs(tiny_model_path):
    """Before any update, Q(s_t, a_t) = log pi_ref(a_t | s_t), and a one-step target is
    r_t + max_a log pi_ref(a | s_{t+1}) (r_T at the last action): by hand from full logits."""
    q = make_q_learner(tiny_model_path, train=OWN_REFERENCE,
                       qlearn={**CALIBRATED, "n_step": 1, "mc_lower_bound": False, "conservative_weight": 0.0})
    batch = _mdp_batch()
    logp = torch.log_softmax(_full_logits(tiny_lm(tiny_model_path), batch.input_ids, batch.attention_mask), -1)
    mask, rewards, done = q.episodes(batch)
    taken, targets = [], []
    for i, t in mask.nonzero().tolist():
        taken.append(float(logp[i, t - 1, batch.input_ids[i, t]]))
        last = t + 1 >= mask.shape[1] or not bool(mask[i, t + 1])
        targets.append(float(rewards[i, t]) + (0.0 if last else float(logp[i, t].max())))
    taken, targets = torch.tensor(taken), torch.tensor(targets)
    m = q.evaluate(batch)
    assert m["eval/q/taken"] == pytest.approx(float(taken.mean()), abs=1e-5)
    assert m["eval/q/target"] == pytest.approx(float(targets.mean()), abs=1e-5)
    assert m["eval/loss/td"] == pytest.approx(float((0.5 * (taken - targets) ** 2).mean()), abs=1e-5)
    assert m["eval/q/max"] <= 1e-6  # the best calibrated Q of a state is a log-probability
    raw = make_q_learner(tiny_model_path, qlearn={"n_step": 1, "mc_lower_bound": False}).evaluate(batch)
    assert abs(raw["eval/q/taken"] - m["eval/q/taken"]) > 0.1  # the raw logits sit elsewhere


def test_calibrated_q_reaches_the_bellman_fixed_point_on_the_calibrated_scale(tiny_model_path):
    """Gamma 0.9, one-step backups: after training, the learned logits minus the initial model's
    log-normaliser satisfy Q(s_t, a_t) = r_t + 0.9 max_a Q(s_{t+1}, a), and Q = r at the last
    actions, computed here from a full forward pass. (No regulariser: tokens outside the data
    take whatever values, as the maximum reads them.)"""
    batch = _mdp_batch()
    q = make_q_learner(tiny_model_path, train={"lr": 3e-3, **OWN_REFERENCE},
                       qlearn={**CALIBRATED, "gamma": 0.9, "mc_lower_bound": False, "conservative_weight": 0.0})
    for _ in range(400):
        metrics = q.train_step(batch)
    logits = _full_logits(q.model.lm, batch.input_ids, batch.attention_mask)
    shift = torch.logsumexp(_full_logits(tiny_lm(tiny_model_path), batch.input_ids, batch.attention_mask), -1)
    Q = logits - shift[..., None]
    mask, rewards, _ = q.episodes(batch)
    checked = 0
    for i, t in mask.nonzero().tolist():
        last = t + 1 >= mask.shape[1] or not bool(mask[i, t + 1])
        want = float(rewards[i, t]) + (0.0 if last else 0.9 * float(Q[i, t].max()))
        assert float(Q[i, t - 1, batch.input_ids[i, t]]) == pytest.approx(want, abs=0.03), (i, t)
        checked += 1
    assert checked == 7 and metrics["loss/td"] < 1e-2
    raw = logits[0, 4, 2]  # the raw logit of the rewarded EOS is not the reward
    assert abs(float(raw) - 1.0) > 0.1


def test_two_learners_take_the_one_learner_calibrated_step(tiny_model_path):
    batch = _mdp_batch()
    hp = {**CALIBRATED, "n_step": 2}
    g1, m1 = step_with_grads(make_q_learner(tiny_model_path, qlearn=hp, train={**OWN_REFERENCE, "micro_batch_size": 8}), batch)
    learners = [make_q_learner(tiny_model_path, qlearn=hp, train={**OWN_REFERENCE, "micro_batch_size": 1}) for _ in range(2)]
    for learner in learners:  # loaded here: two threads in from_pretrained at once share its meta-device context
        learner._frozen_reference()
    for g, m in run_ranks(2, lambda rank, comm: step_with_grads(learners[rank], batch, comm)):
        torch.testing.assert_close(g["g"], g1["g"], atol=2e-6, rtol=1e-4)
        for key in ("loss/td", "loss/conservative", "q/taken", "q/target"):
            assert m[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-7), key
    assert g1["g"].abs().sum() > 0


def test_the_config_refuses_calibration_it_cannot_run():
    base = ["run.algorithm=qlearn", "qlearn.calibration=reference"]
    with pytest.raises(ConfigError, match="train.reference=learners"):
        load_config(None, base + ["qlearn.conservative=logsumexp"])
    with pytest.raises(ConfigError, match="conservative=logsumexp"):
        load_config(None, base + ["train.reference=learners"])
    load_config(None, base + ["train.reference=learners", "qlearn.conservative=logsumexp"])
    load_config(None, base + ["lora.enabled=true", "qlearn.conservative_weight=0"])
