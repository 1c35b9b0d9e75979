"""Shared-prefix forward passes: a prompt's samples run the prompt once; outputs and gradients
must equal running every row in full."""

import torch

from learners.modeling import PolicyWithValueHead, shared_prefix_hidden


def _grouped_batch(vocab: int, seed: int = 0):
    """Three prompts (lengths 5, 7, 4) with 3, 2 and 1 samples of ragged response lengths,
    rows right-padded, groups interleaved (not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    prompts = {10: torch.randint(3, vocab, (5,), generator=g), 20: torch.randint(3, vocab, (7,), generator=g),
               30: torch.randint(3, vocab, (4,), generator=g)}
    rows = [(10, 6), (20, 3), (10, 2), (30, 5), (20, 8), (10, 4)]  # (group, response length)
    length = max(len(prompts[gid]) + r for gid, r in rows) + 2
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    att = torch.zeros(len(rows), length, dtype=torch.bool)
    rm = torch.zeros_like(att)
    for i, (gid, r) in enumerate(rows):
        p = prompts[gid]
        ids[i, : len(p)] = p
        ids[i, len(p) : len(p) + r] = torch.randint(3, vocab, (r,), generator=g)
        att[i, : len(p) + r] = True
        rm[i, len(p) : len(p) + r] = True
    return ids, att, rm, torch.tensor([gid for gid, _ in rows])


def _policy(tiny_model_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    lm.config.use_cache = False
    model = PolicyWithValueHead(lm)
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    return model


def test_shared_prefix_matches_full_rows(tiny_model_path):
    model = _policy(tiny_model_path)
    ids, att, rm, groups = _grouped_batch(model.lm.config.vocab_size)
    outs, grads = [], []
    for group_ids in (None, groups):
        model.zero_grad()
        out = model(ids, att, rm, with_values=True, with_entropy=True, group_ids=group_ids)
        ((out["logprobs"] * rm).sum() + (out["values"] * rm).sum()).backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    full, shared = outs
    for k in ("logprobs", "values", "entropy"):
        torch.testing.assert_close(shared[k], full[k], atol=1e-5, rtol=1e-5)
        assert (shared[k][~rm] == 0).all()
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4)


def test_shared_prefix_falls_back_when_it_cannot_share(tiny_model_path):
    model = _policy(tiny_model_path)
    decoder = model.lm.get_decoder()
    ids, att, rm, groups = _grouped_batch(model.lm.config.vocab_size)
    # Every row its own group: nothing to share.
    assert shared_prefix_hidden(decoder, ids, att, rm, torch.arange(len(groups))) is None
    # A group whose rows disagree on the prompt: refused rather than silently wrong.
    bad = ids.clone()
    bad[2, 1] = (bad[2, 1] + 1) % model.lm.config.vocab_size
    assert shared_prefix_hidden(decoder, bad, att, rm, groups) is None
    # A row with no output position (e.g. masked out as truncated).
    rm2 = rm.clone()
    rm2[3] = False
    assert shared_prefix_hidden(decoder, ids, att, rm2, groups) is None
    # ... and the forward still works (rows in full), matching the ungrouped pass.
    torch.testing.assert_close(model(bad, att, rm, group_ids=groups)["logprobs"], model(bad, att, rm)["logprobs"])


def test_sequence_logprobs_with_groups_matches(tiny_model_path):
    """The reference / old-policy pass: grouped micro-batches (a micro-batch boundary inside the
    batch, so ordering and scatter-back are exercised) give the same log-probs."""
    from learners.modeling import sequence_logprobs

    model = _policy(tiny_model_path)
    ids, att, rm, groups = _grouped_batch(model.lm.config.vocab_size, seed=1)
    with torch.no_grad():
        plain = sequence_logprobs(model.lm, ids, att, rm, micro_batch_size=4)
        grouped = sequence_logprobs(model.lm, ids, att, rm, micro_batch_size=4, group_ids=groups)
    torch.testing.assert_close(grouped, plain, atol=1e-5, rtol=1e-5)
    assert (grouped[~rm] == 0).all() and (grouped[rm] < 0).all()


def test_learner_update_is_the_same_with_and_without_sharing(tiny_model_path):
    from cluster.config import PPOConfig
    from learners.experience import Experience
    from learners.modeling import sequence_logprobs
    from learners.ppo import PPOLearner

    results = []
    for shared in (False, True):
        hp = PPOConfig(lr=1e-2, epochs=1, minibatch_size=6, micro_batch_size=3, bf16=False,
                       advantage_estimator="grpo", kl_coef=0.0, shared_prefix=shared)
        learner = PPOLearner(tiny_model_path, hp, seed=0)
        ids, att, rm, groups = _grouped_batch(learner.model.lm.config.vocab_size, seed=2)
        with torch.no_grad():
            lp0 = sequence_logprobs(learner.model.lm, ids, att, rm)
        exp = Experience(ids, att, rm, lp0, groups, torch.zeros(6, dtype=torch.bool), 0, [""] * 6, [{}] * 6,
                         scores=torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5]))
        m = learner.train_step(exp)
        # Micro-batches of 3 rows keep groups together (sizes 3, 2, 1): the two multi-row groups share.
        assert m["learner/prefix_shared_frac"] == (0.0 if not shared else 1.0), m["learner/prefix_shared_frac"]
        assert m["logprob_gap/max_abs"] < 1e-5
        results.append([p.detach().clone() for p in learner.model.lm.parameters()])
    # Adam's first step is about lr * sign(grad) (lr = 1e-2): summation-order noise can flip a
    # near-zero gradient element, so compare the update's direction and bound any element by
    # a small share of one step.
    a = torch.cat([x.flatten() for x in results[0]])
    b = torch.cat([y.flatten() for y in results[1]])
    assert (a - b).abs().max() < 5e-4
    assert (a - b).abs().mean() < 1e-5
