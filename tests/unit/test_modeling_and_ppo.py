"""The learner's forward passes and one PPO update, on the tiny model, without Ray.

Two computation paths of one update are compared through the gradients they hand to the
optimiser (captured with ``on_gradients``, before clipping and the step) and through their
losses, never through parameters after an Adam step (Adam's first step is about lr * sign(grad):
flaky on near-zero elements and blind to gradient-scale errors).
"""

import torch

from learners.training.modeling import sequence_logprobs
from tests.helpers.factories import experience, flat_grads, make_learner, ragged_batch, tiny_lm

# Gradients of two paths that differ only in float summation order.
GRAD_TOL = dict(atol=1e-6, rtol=1e-4)
SCORES = [1.0, 0.0, 0.5, 0.0, 1.0, 0.2]


def _batch(lm, **kw):
    """Thin alias of ``tests.helpers.factories.ragged_batch`` for older imports."""
    return ragged_batch(lm.config.vocab_size, **kw)


def _step_capturing_gradients(path, batch, *, train, ppo):
    """One train_step on a fresh learner; returns (metrics, the global gradient it stepped with)."""
    learner = make_learner(path, train=train, ppo=ppo, seed=0)
    captured = []
    learner.on_gradients = lambda params: captured.append(flat_grads(params))
    metrics = learner.train_step(batch)
    assert len(captured) == train.get("epochs", 1) * train.get("num_minibatches", 1)
    return metrics, captured[0]


def test_chunked_logprobs_match_full_log_softmax(tiny_model_path):
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = ragged_batch(lm.config.vocab_size)
    got = sequence_logprobs(lm, ids, att, rm, chunk=5, micro_batch_size=4)
    with torch.no_grad():
        logits = lm(input_ids=ids, attention_mask=att.long()).logits
    naive = torch.zeros_like(got)
    for i in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if rm[i, t]:
                naive[i, t] = torch.log_softmax(logits[i, t - 1], -1)[ids[i, t]]
    torch.testing.assert_close(got, naive, atol=1e-5, rtol=1e-5)
    assert (got[~rm] == 0).all()


def test_ppo_step_moves_policy_towards_rewarded_samples(tiny_model_path):
    learner = make_learner(
        tiny_model_path,
        train={"lr": 1e-2, "epochs": 4, "num_minibatches": 1, "micro_batch_size": 3},
        ppo={"critic_lr": 1e-2, "kl_coef": 0.0},
        seed=0,
    )
    lm = learner.model.lm
    ids, att, rm = ragged_batch(lm.config.vocab_size)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    exp = experience(lm, ids, att, rm, scores.tolist())
    lp0 = exp.rollout_logprobs
    value_head0 = learner.model.value_head.weight.detach().clone()
    metrics = learner.train_step(exp)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    # Several epochs: the separate old-policy pass ran (neither on-policy shortcut).
    assert metrics["learner/fused_old_pass"] == 0.0 and metrics["learner/streamed_old_pass"] == 0.0
    assert metrics["learner/stale_batch"] == 0.0
    # The trainer reproduces the rollout log-probs of the same weights.
    assert metrics["logprob_gap/max_abs"] < 1e-5
    # GAE (the default estimator) trained its critic.
    assert metrics["loss/value"] > 0 and "value/mean" in metrics
    assert not torch.equal(learner.model.value_head.weight, value_head0)
    with torch.no_grad():
        lp1 = sequence_logprobs(lm, ids, att, rm)
    seq_gain = ((lp1 - lp0) * rm).sum(1)
    assert seq_gain[scores == 1].mean() > seq_gain[scores == 0].mean()
    assert learner.version == 1
    sd = learner.policy_state_dict()
    assert "lm_head.weight" not in sd  # tied to the embedding: not sent twice
    assert not any(k.startswith("value_head") for k in sd)


def test_fused_on_policy_step_equals_separate_old_pass(tiny_model_path):
    """One epoch, one minibatch: reusing the training forward as the 'old' pass is exact."""
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = ragged_batch(lm.config.vocab_size)
    exp = experience(lm, ids, att, rm, SCORES, ref_shift=0.01)
    results = {}
    # 6: fused path (one micro-batch holds the batch); 3: separate no-grad old pass (the critic
    # needs old values before the update), then two micro-batches.
    for micro in (6, 3):
        m, g = _step_capturing_gradients(
            tiny_model_path,
            exp,
            train={"lr": 1e-2, "epochs": 1, "num_minibatches": 1, "micro_batch_size": micro},
            ppo={"critic_lr": 1e-2, "advantage_estimator": "gae", "kl_coef": 0.05},
        )
        assert m["learner/fused_old_pass"] == float(micro == 6)
        assert m["learner/streamed_old_pass"] == 0.0 and m["learner/stale_batch"] == 0.0
        results[micro] = (m, g)
    (m_a, g_a), (m_b, g_b) = results[6], results[3]
    # A real gradient, on the policy and on the critic (value head: the last parameters).
    assert g_a.abs().sum() > 0 and g_a[-lm.config.hidden_size - 1 :].abs().sum() > 0
    torch.testing.assert_close(g_b, g_a, **GRAD_TOL)
    for k in (
        "loss/policy",
        "loss/value",
        "loss/total",
        "kl/ref_k1",
        "advantage/mean",
        "policy/entropy",
        "policy/grad_norm",
        "value/mean",
    ):
        torch.testing.assert_close(m_b[k], m_a[k], atol=1e-6, rtol=1e-4, msg=k)
    # The KL to the reference (shifted by 0.01) entered the rewards on both paths.
    assert abs(m_a["kl/ref_k1"] - 0.01) < 1e-5


def test_streamed_on_policy_step_equals_fused(tiny_model_path):
    """No critic and no KL in the reward: the advantages need no forward pass, so one on-policy
    update can stream length-sorted, trimmed micro-batches (each its own old pass) and still
    equal the single fused pass over the whole batch."""
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = ragged_batch(lm.config.vocab_size)
    exp = experience(lm, ids, att, rm, SCORES, groups=[0, 0, 0, 1, 1, 1], ref_shift=None)
    results = {}
    for micro in (6, 2):
        m, g = _step_capturing_gradients(
            tiny_model_path,
            exp,
            train={"lr": 1e-2, "epochs": 1, "num_minibatches": 1, "micro_batch_size": micro},
            ppo={"advantage_estimator": "grpo", "kl_coef": 0.0},
        )
        assert (m["learner/fused_old_pass"], m["learner/streamed_old_pass"]) == (
            (1.0, 0.0) if micro == 6 else (0.0, 1.0)
        )
        # The old pass is the policy before the update: it matches the rollout log-probs.
        assert m["logprob_gap/max_abs"] < 1e-5
        results[micro] = (m, g)
    (m_a, g_a), (m_b, g_b) = results[6], results[2]
    assert g_a.abs().sum() > 0
    torch.testing.assert_close(g_b, g_a, **GRAD_TOL)
    for k in ("loss/policy", "loss/total", "advantage/mean", "policy/entropy", "policy/grad_norm"):
        torch.testing.assert_close(m_b[k], m_a[k], atol=1e-6, rtol=1e-4, msg=k)
    # GRPO ran: each row's advantage is its score normalised by its group's mean and (unbiased)
    # std: group 0 (1, 0, 0.5) -> (1, -1, 0), group 1 (0, 1, 0.2) -> (-0.76, 1.13, -0.38); the
    # metric is their mean over response tokens.
    s = torch.tensor(SCORES).view(2, 3)
    adv = ((s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + 1e-6)).view(-1)
    lengths = rm.sum(1).float()
    expected = float((adv * lengths).sum() / lengths.sum())
    assert abs(m_a["advantage/mean"] - expected) < 1e-5


def test_an_empty_record_passes_through_the_reference_pass(tiny_model_path):
    """A batch whose every sample was dropped upstream (all rewards failed) reaches the reference
    and the learner empty: both return without error (it used to crash the reference)."""
    from actors.reference import Reference
    from tests.helpers.factories import experience, make_learner, ragged_batch, tiny_lm

    lm = tiny_lm(tiny_model_path)
    ids, att, rm = ragged_batch(lm.config.vocab_size)
    empty = experience(lm, ids, att, rm, [1.0] * 6).select([])
    out, _ = Reference(tiny_model_path).annotate(empty)
    assert out.batch_size == 0 and out.ref_logprobs.shape == (0, ids.shape[1])
    assert make_learner(tiny_model_path).train_step(out)["learner/empty_batch"] == 1.0


def test_fused_head_logprobs_give_the_plain_paths_ppo_gradient(tiny_model_path, monkeypatch):
    """train.fused_logprobs: the LM head's log-probs chunked through the backward pass too
    (learners/logprob_kernel.fused_head_logprobs) give the same update as the plain chunked head, on the
    tied embedding and the trunk, in fp32 and under bf16 autocast."""
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = ragged_batch(lm.config.vocab_size)
    exp = experience(lm, ids, att, rm, SCORES, ref_shift=0.01)
    ppo = {"critic_lr": 1e-2, "advantage_estimator": "gae", "kl_coef": 0.05}
    import learners.training.modeling

    calls = []
    real = learners.training.modeling.fused_head_logprobs
    monkeypatch.setattr(
        learners.training.modeling, "fused_head_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    for bf16, tol in ((False, GRAD_TOL), (True, dict(atol=2e-3, rtol=2e-2))):
        runs = {}
        for fused in (False, True):
            train = {"lr": 1e-2, "micro_batch_size": 3, "logprob_chunk": 7, "fused_logprobs": fused, "bf16": bf16}
            calls.clear()
            runs[fused] = _step_capturing_gradients(tiny_model_path, exp, train=train, ppo=ppo)
            assert bool(calls) == fused  # the fused head ran exactly when asked for
        (m_plain, g_plain), (m_fused, g_fused) = runs[False], runs[True]
        assert g_plain.abs().sum() > 0
        torch.testing.assert_close(g_fused, g_plain, **tol)
        for k in ("loss/policy", "loss/total", "policy/entropy", "kl/ref_k1"):
            torch.testing.assert_close(m_fused[k], m_plain[k], atol=1e-5 if not bf16 else 1e-3, rtol=1e-4, msg=k)


def _count_rows(learner):
    """Wraps the learner's forward pass to count the rows it trains on (passes with gradients)."""
    ran = []
    forward = learner._forward

    def counting(exp, *, grad, **kwargs):
        ran.append(exp.batch_size if grad else 0)
        return forward(exp, grad=grad, **kwargs)

    learner._forward = counting
    return ran


def test_zero_advantage_rows_skip_their_passes_with_the_same_step(tiny_model_path):
    """A GRPO group whose samples all scored the same has advantage 0 at every token: with no
    critic, KL or entropy term its rows add exactly 0 to the loss and the gradient. Skipping
    their passes (while their tokens stay in the token-mean normaliser) gives the same gradient
    and loss as running them: on the fused path (one micro-batch), the streamed one, and a stale
    batch (sampled by an older version: a separate old pass, truncated importance weights)."""
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = ragged_batch(lm.config.vocab_size)
    scores, groups = [1.0, 0.0, 0.2, 0.3, 0.3, 0.3], [0, 0, 0, 1, 1, 1]
    exp = experience(lm, ids, att, rm, scores, groups=groups, ref_shift=None)
    stale = experience(lm, ids, att, rm, scores, groups=groups, ref_shift=None, version=-1)
    stale = stale.replace(rollout_logprobs=stale.rollout_logprobs - 0.3 * rm.float())  # an older sampler
    for micro, batch, correction in ((6, exp, "none"), (2, exp, "none"), (2, stale, "truncate")):
        train = {"lr": 1e-2, "epochs": 1, "num_minibatches": 1, "micro_batch_size": micro}
        results = {}
        for skip in (True, False):
            learner = make_learner(
                tiny_model_path,
                train=train,
                ppo={
                    "advantage_estimator": "grpo",
                    "kl_coef": 0.0,
                    "skip_zero_advantage": skip,
                    "rollout_correction": correction,
                },
            )
            ran = _count_rows(learner)
            captured = []
            learner.on_gradients = lambda params: captured.append(flat_grads(params))
            results[skip] = (learner.train_step(batch), captured[0], sum(ran))
        (m_s, g_s, rows_s), (m_f, g_f, rows_f) = results[True], results[False]
        assert (rows_s, rows_f) == (3, 6), micro
        assert m_s["learner/stale_batch"] == float(batch is stale)
        assert m_s["learner/zero_advantage_rows"] == 3.0 and "learner/zero_advantage_rows" not in m_f
        assert m_s["learner/trained_tokens"] == float(rm[:3].sum()) and m_f["learner/trained_tokens"] == float(rm.sum())
        assert m_s["learner/tokens"] == m_f["learner/tokens"]
        assert g_f.abs().sum() > 0
        torch.testing.assert_close(g_s, g_f, **GRAD_TOL)
        for k in ("loss/policy", "loss/total", "advantage/mean", "policy/grad_norm"):
            torch.testing.assert_close(m_s[k], m_f[k], atol=1e-6, rtol=1e-4, msg=k)
        # The log-prob gap is measured on the rows that ran: the on-policy 0, or the stale 0.3.
        assert abs(m_s["logprob_gap/max_abs"] - (0.3 if batch is stale else 0.0)) < 1e-5
        if batch is stale:
            # Float32 log-probs of rows batched differently: equal to rounding (a few 1e-7 with AVX-512).
            torch.testing.assert_close(
                m_s["rollout_is/weight_mean"], m_f["rollout_is/weight_mean"], atol=1e-6, rtol=1e-5
            )


def test_zero_advantage_rows_are_not_skipped_where_they_carry_a_gradient(tiny_model_path):
    """An entropy bonus, a KL term or a critic gives a zero-advantage row a gradient of its own:
    then every row runs."""
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = ragged_batch(lm.config.vocab_size)
    exp = experience(lm, ids, att, rm, [1.0, 0.0, 0.2, 0.3, 0.3, 0.3], groups=[0, 0, 0, 1, 1, 1], ref_shift=0.01)
    for ppo in ({"entropy_coef": 0.01, "kl_coef": 0.0}, {"kl_coef": 0.05}, {"kl_coef": 0.0, "kl_loss_coef": 0.1}):
        learner = make_learner(
            tiny_model_path, train={"micro_batch_size": 2}, ppo={"advantage_estimator": "grpo", **ppo}
        )
        ran = _count_rows(learner)
        m = learner.train_step(exp)
        assert "learner/zero_advantage_rows" not in m and sum(ran) == 6, ppo


def test_a_batch_with_no_advantage_still_steps_the_optimiser(tiny_model_path):
    """Every group scored evenly: no pass runs, yet AdamW steps every parameter with a zero
    gradient (its moments from the step before still move the weights), exactly as when the
    rows ran and added 0."""
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = ragged_batch(lm.config.vocab_size)
    groups = [0, 0, 0, 1, 1, 1]
    # No zero-advantage row in the first batch: both learners take the identical first step.
    first = experience(lm, ids, att, rm, [1.0, 0.0, 0.2, 0.0, 1.0, 0.3], groups=groups, ref_shift=None)
    flat = experience(lm, ids, att, rm, [0.0, 0.0, 0.0, 1.0, 1.0, 1.0], groups=groups, ref_shift=None)
    params = {}
    for skip in (True, False):
        learner = make_learner(
            tiny_model_path,
            train={"lr": 1e-2, "micro_batch_size": 2},
            ppo={"advantage_estimator": "grpo", "kl_coef": 0.0, "skip_zero_advantage": skip},
        )
        learner.train_step(first)
        before = torch.cat([p.detach().reshape(-1).clone() for p in learner.trainable])
        m = learner.train_step(flat)
        assert m.get("learner/zero_advantage_rows") == (6.0 if skip else None)
        assert m["loss/policy"] == 0.0 and m["policy/grad_norm"] == 0.0
        # No row ran: the policy's statistics were not measured, so they are absent, not zeros.
        assert ("policy/entropy" in m, "logprob_gap/max_abs" in m) == (not skip, not skip)
        params[skip] = torch.cat([p.detach().reshape(-1).clone() for p in learner.trainable])
        assert (params[skip] - before).abs().max() > 1e-4  # the moments moved the weights
    torch.testing.assert_close(params[True], params[False], atol=1e-7, rtol=0)
