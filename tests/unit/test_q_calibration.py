"""Calibrated Q (``qlearn.calibration=reference``): soft Q-learning with the initial model as
prior, Q = logits - the reference's logits and the backups' soft value V = logsumexp(logits) -
logsumexp(logits_ref). The reference terms against a full forward pass; Q and the targets by hand
(at the start: 0 and the rewards); trained, Q satisfies the soft Bellman equation of a token MDP;
N learners take one learner's step; the config refuses what cannot work."""

import pytest
import torch

from cluster.config import ConfigError
from cluster.config.loading import load_config
from learners.training.modeling import reference_logit_terms
from tests.helpers.collective import run_ranks
from tests.helpers.factories import make_q_learner, mdp_batch, ragged_batch, step_with_grads, tiny_lm

CALIBRATED = {"calibration": "reference", "conservative": "logsumexp"}
OWN_REFERENCE = {"reference": "learners", "shared_prefix": False}


def _full_logits(lm, ids, att) -> torch.Tensor:
    with torch.no_grad():
        return lm(input_ids=ids, attention_mask=att.long()).logits.float()


def test_reference_terms_equal_a_full_forward_pass(tiny_model_path):
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = ragged_batch(lm.config.vocab_size, b=5)
    states = rm & (torch.rand(rm.shape, generator=torch.Generator().manual_seed(1)) < 0.7)
    got = reference_logit_terms(lm, ids, att, states, rm, micro_batch_size=2, chunk=3)
    logits = _full_logits(lm, ids, att)
    torch.testing.assert_close(
        got["logsumexp"], torch.where(states, torch.logsumexp(logits, -1), 0.0), atol=1e-5, rtol=1e-5
    )
    taken = torch.zeros_like(got["taken"])
    taken[:, 1:] = logits[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)
    torch.testing.assert_close(got["taken"], torch.where(rm, taken, 0.0), atol=1e-5, rtol=1e-5)


def _by_hand(q, batch, ref_logits, gamma=1.0):
    """(Q of each action, its one-step target) from full forward passes of the online network,
    the target network and the reference."""
    online = _full_logits(q.model.lm, batch.input_ids, batch.attention_mask)
    with q.target_network():
        target = _full_logits(q.model.lm, batch.input_ids, batch.attention_mask)
    mask, rewards, _ = q.episodes(batch)
    qs, ys = [], []
    for i, t in mask.nonzero().tolist():
        a = batch.input_ids[i, t]
        qs.append(float(online[i, t - 1, a] - ref_logits[i, t - 1, a]))
        last = t + 1 >= mask.shape[1] or not bool(mask[i, t + 1])
        value = 0.0 if last else float(torch.logsumexp(target[i, t], -1) - torch.logsumexp(ref_logits[i, t], -1))
        ys.append(float(rewards[i, t]) + gamma * value)
    return torch.tensor(qs), torch.tensor(ys)


def test_calibrated_q_and_its_targets_by_hand(tiny_model_path):
    """At the start Q = 0 for every action and the targets are the rewards; after three updates
    (target network an EMA behind the online one) Q = logits - logits_ref of the taken token and
    y = r + logsumexp(target logits) - logsumexp(reference logits) of the next state."""
    q = make_q_learner(
        tiny_model_path,
        train={"lr": 1e-3, **OWN_REFERENCE},
        qlearn={**CALIBRATED, "n_step": 1, "mc_lower_bound": False, "target_decay": 0.5},
    )
    batch = mdp_batch()
    ref_logits = _full_logits(tiny_lm(tiny_model_path), batch.input_ids, batch.attention_mask)
    _, rewards, _ = q.episodes(batch)
    start = q.evaluate(batch)
    assert start["eval/q/taken"] == pytest.approx(0.0, abs=1e-5)
    assert start["eval/q/target"] == pytest.approx(float(rewards.sum()) / 7, abs=1e-5)
    for _ in range(3):
        q.train_step(batch)
    qs, ys = _by_hand(q, batch, ref_logits)
    m = q.evaluate(batch)
    assert m["eval/q/taken"] == pytest.approx(float(qs.mean()), abs=1e-5)
    assert m["eval/q/target"] == pytest.approx(float(ys.mean()), abs=1e-5)
    assert m["eval/loss/td"] == pytest.approx(float((0.5 * (qs - ys) ** 2).mean()), abs=1e-5)
    assert qs.abs().max() > 0.05 and (ys - rewards[rewards != 0].sum() / 7).abs().max() > 0.01  # moved
    raw = make_q_learner(tiny_model_path, qlearn={"n_step": 1, "mc_lower_bound": False}).evaluate(batch)
    assert abs(raw["eval/q/taken"]) > 0.1  # raw Q: the logits themselves


def test_calibrated_q_reaches_the_soft_bellman_fixed_point(tiny_model_path):
    """Gamma 0.9, one-step backups, no regulariser: after training, Q(s_t, a_t) = r_t + 0.9 V(s_{t+1})
    with Q and V measured against the reference, and Q = r at the last actions, from full passes."""
    batch = mdp_batch()
    q = make_q_learner(
        tiny_model_path,
        train={"lr": 1e-3, **OWN_REFERENCE},
        qlearn={**CALIBRATED, "gamma": 0.9, "mc_lower_bound": False, "conservative_weight": 0.0},
    )
    for _ in range(400):
        metrics = q.train_step(batch)
    ref_logits = _full_logits(tiny_lm(tiny_model_path), batch.input_ids, batch.attention_mask)
    q.target_params = [p.detach() for p in q.trainable]  # V of the online network itself
    qs, ys = _by_hand(q, batch, ref_logits, gamma=0.9)
    torch.testing.assert_close(qs, ys, atol=0.01, rtol=0)
    assert metrics["loss/td"] < 1e-2
    # The rewarded last action's Q rose from 0 to its reward; the others carry the soft value's
    # KL cost of leaving the (near-uniform) prior for the data's tokens.
    assert float(qs.max()) == pytest.approx(1.0, abs=0.01)


def test_two_learners_take_the_one_learner_calibrated_step(tiny_model_path):
    batch = mdp_batch()
    hp = {**CALIBRATED, "n_step": 2}
    g1, m1 = step_with_grads(
        make_q_learner(tiny_model_path, qlearn=hp, train={**OWN_REFERENCE, "micro_batch_size": 8}), batch
    )
    learners = [
        make_q_learner(tiny_model_path, qlearn=hp, train={**OWN_REFERENCE, "micro_batch_size": 1}) for _ in range(2)
    ]
    seen: list[list[int]] = [[], []]  # rows of each rank's reference passes
    for rank, learner in enumerate(
        learners
    ):  # loaded here: two threads in from_pretrained at once share its meta-device context
        learner._frozen_reference()
        terms = learner.base_logit_terms
        learner.base_logit_terms = lambda ids, *a, _t=terms, _s=seen[rank]: _s.append(ids.shape[0]) or _t(ids, *a)
    for g, m in run_ranks(2, lambda rank, comm: step_with_grads(learners[rank], batch, comm)):
        torch.testing.assert_close(g["g"], g1["g"], atol=2e-6, rtol=1e-4)
        for key in ("loss/td", "loss/conservative", "q/taken", "q/target"):
            assert m[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-7), key
    assert g1["g"].abs().sum() > 0
    # Each rank ran the reference over its own rows only: together, the batch once.
    assert all(seen) and sum(n for rank in seen for n in rank) == batch.batch_size


def test_the_config_refuses_calibration_it_cannot_run():
    base = ["run.algorithm=qlearn", "qlearn.calibration=reference"]
    with pytest.raises(ConfigError, match="train.reference=learners"):
        load_config(None, base + ["qlearn.conservative=logsumexp"])
    with pytest.raises(ConfigError, match="conservative=logsumexp"):
        load_config(None, base + ["train.reference=learners"])
    load_config(None, base + ["train.reference=learners", "qlearn.conservative=logsumexp"])
    load_config(None, base + ["lora.enabled=true", "qlearn.conservative_weight=0"])
