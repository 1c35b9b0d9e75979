"""Token-level Q-learning: Bellman targets against hand-computed values and a naive loop, the
chunked vocabulary reductions against full logits, the EMA target network (exact moves, resume),
and the learner solving small deterministic token MDPs whose optimal Q-values are known."""

import math

import pytest
import torch

from learners.objectives.advantages import (
    discounted_returns,
    episode_mask,
    q_learning_targets,
    reads_bootstrap,
    token_rewards_from_scores,
)
from learners.experience import ExperienceError
from learners.objectives.td_losses import conservative_penalty, cql_penalty, td_loss
from learners.training.modeling import max_q_after_positions, q_heads_at_positions
from learners.training.optim import ema_update_
from tests.helpers.collective import run_ranks
from tests.helpers.factories import (
    experience,
    step_with_grads,
    grouped_batch,
    make_q_learner,
    mdp_batch,
    ragged_batch,
    tiny_lm,
    transitions_batch,
)

# -- Bellman targets ---------------------------------------------------------------------------------


def naive_targets(rewards, next_max, mask, done, gamma, n, mc):
    """Row by row, token by token: the definition in q_learning_targets' docstring."""
    out = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        pos = [t for t in range(rewards.shape[1]) if mask[b, t]]
        for i, t in enumerate(pos):
            rest = pos[i:]
            j = min(n, len(rest))
            y = sum(gamma**k * float(rewards[b, rest[k]]) for k in range(j))
            u = rest[j - 1]
            if not (u == pos[-1] and done[b]):
                y += gamma**j * float(next_max[b, u])
            if mc:
                y = max(y, sum(gamma**k * float(rewards[b, s]) for k, s in enumerate(rest)))
            out[b, t] = y
    return out


def test_one_step_targets_by_hand():
    # One row: prompt at 0-1, actions at 2, 3, 4 (done), padding at 5.
    r = torch.tensor([[0.0, 0.0, 0.0, 0.5, 1.0, 0.0]])
    nxt = torch.tensor([[9.0, 9.0, 2.0, 3.0, 4.0, 9.0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    y = q_learning_targets(r, nxt, mask, torch.tensor([True]), gamma=0.5)
    # no reward at t=2: gamma * max Q(s_3); reward and bootstrap at t=3; the terminal reward alone at t=4.
    assert y.tolist() == [[0.0, 0.0, 0.5 * 2.0, 0.5 + 0.5 * 3.0, 1.0, 0.0]]
    # Cut at the length limit (not done): the last action bootstraps too.
    y = q_learning_targets(r, nxt, mask, torch.tensor([False]), gamma=0.5)
    assert y[0, 4].item() == 1.0 + 0.5 * 4.0
    # Two steps by hand: y_2 = r_2 + g r_3 + g^2 max Q(s_4) = 0 + 0.25 + 0.25 * 3.
    y = q_learning_targets(r, nxt, mask, torch.tensor([True]), gamma=0.5, n_step=2)
    assert y[0, 2].item() == pytest.approx(0.25 + 0.25 * 3.0)
    assert y[0, 3].item() == pytest.approx(0.5 + 0.5 * 1.0)  # r_3 + g r_4, episode over


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("mc", [False, True])
def test_targets_match_a_naive_loop(gamma, n, mc):
    g = torch.Generator().manual_seed(n * 10 + int(mc))
    B, T = 5, 9
    rewards = torch.randn(B, T, generator=g)
    nxt = torch.randn(B, T, generator=g) * 3
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (s, e) in enumerate([(2, 9), (3, 6), (1, 2), (4, 8), (0, 0)]):  # ragged, one empty row
        mask[b, s:e] = True
    done = torch.tensor([True, False, True, False, True])
    y = q_learning_targets(rewards, nxt, mask, done, gamma=gamma, n_step=n, mc_lower_bound=mc)
    torch.testing.assert_close(y, naive_targets(rewards, nxt, mask, done, gamma, n, mc), atol=1e-5, rtol=1e-5)
    assert not bool(y[~mask].any())


def test_mc_lower_bound_never_lets_a_target_fall_below_the_observed_return():
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(64, 12, generator=g)
    nxt = -5 * torch.rand(64, 12, generator=g)  # a pessimistic target network
    mask = torch.zeros(64, 12, dtype=torch.bool)
    for b in range(64):
        mask[b, 2 + b % 3 : 12 - b % 5] = True
    done = torch.rand(64, generator=g) > 0.5
    returns = discounted_returns(rewards, mask, 0.95)
    bounded = q_learning_targets(rewards, nxt, mask, done, gamma=0.95, mc_lower_bound=True)
    plain = q_learning_targets(rewards, nxt, mask, done, gamma=0.95)
    assert bool((bounded[mask] >= returns[mask] - 1e-6).all())
    assert bool((plain[mask] < returns[mask] - 1e-3).any())  # without it they do fall below
    assert bool((bounded >= plain - 1e-6).all())


@pytest.mark.parametrize("n", [1, 3, 5, 6, 7])
def test_targets_read_the_target_network_exactly_when_reads_bootstrap_says_so(n):
    # A three-turn row of 6 actions (observations between the turns), a row of 3, an empty row.
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, [1, 2, 4, 5, 8, 9]] = True
    mask[1, 3:6] = True
    g = torch.Generator().manual_seed(n)
    rewards = torch.randn(3, 10, generator=g)
    for done in ([True, True, True], [True, False, True], [True, True, False]):
        done = torch.tensor(done)
        without = q_learning_targets(rewards, torch.zeros(3, 10), mask, done, n_step=n, mc_lower_bound=True)
        other = 5 + torch.rand(3, 10, generator=g)  # above every return: the bound never hides it
        with_it = q_learning_targets(rewards, other, mask, done, n_step=n, mc_lower_bound=True)
        assert reads_bootstrap(mask, done, n) == (not torch.equal(without, with_it)), done
    # Monte-Carlo over whole finished episodes (n at least the longest one) reads nothing.
    assert reads_bootstrap(mask, torch.tensor([True, True, False]), n) == (n < 6)


@pytest.mark.parametrize("n_step", [1, 3])
def test_the_target_network_pass_is_skipped_only_where_no_target_reads_it(tiny_model_path, monkeypatch, n_step):
    """``mdp_batch``'s episodes are 2-3 actions long: with n_step 3 every window ends its episode,
    the learner runs no target pass and takes the step of a learner that runs it; with 1 it runs it."""
    import learners.qlearn as qlearn

    passes = []
    real = qlearn.max_q_after_positions
    monkeypatch.setattr(qlearn, "max_q_after_positions", lambda *a, **k: passes.append(1) or real(*a, **k))
    hp = {"n_step": n_step, "target_start_step": 0}
    g_skip, m_skip = step_with_grads(make_q_learner(tiny_model_path, qlearn=hp), mdp_batch())
    skipped_passes = len(passes)
    monkeypatch.setattr(qlearn, "reads_bootstrap", lambda *a, **k: True)
    g_full, m_full = step_with_grads(make_q_learner(tiny_model_path, qlearn=hp), mdp_batch())
    assert len(passes) > skipped_passes
    assert (skipped_passes == 0) == (n_step == 3)
    assert m_skip["learner/target_pass"] == float(n_step == 1) and m_full["learner/target_pass"] == 1.0
    if n_step == 3:
        torch.testing.assert_close(g_skip["g"], g_full["g"], atol=0, rtol=0)
        assert m_skip["q/target"] == m_full["q/target"]


def test_episode_ends_at_the_first_eos_and_the_score_lands_on_the_last_action():
    ids = torch.tensor([[7, 7, 5, 2, 6, 2], [7, 5, 6, 6, 0, 0], [7, 7, 2, 5, 0, 0]])
    rm = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    mask, ended = episode_mask(ids, rm, [2])
    assert mask.long().tolist() == [[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0]]
    assert ended.tolist() == [True, False, True]
    r = token_rewards_from_scores(torch.tensor([1.0, 0.5, -1.0]), mask)
    assert r.tolist() == [[0, 0, 0, 1.0, 0, 0], [0, 0, 0, 0.5, 0, 0], [0, 0, -1.0, 0, 0, 0]]


# -- the vocabulary reductions ----------------------------------------------------------------------


def test_chunked_q_heads_equal_full_logits_values_and_gradients(tiny_model_path):
    lm = tiny_lm(tiny_model_path)
    ids, att, rm = ragged_batch(lm.config.vocab_size, b=4)
    head = lm.get_output_embeddings()

    def run(chunk):
        hidden = lm.get_decoder()(input_ids=ids, attention_mask=att.long()).last_hidden_state
        out = q_heads_at_positions(hidden, ids, rm, head, floor=0.3, temperature=0.7, chunk=chunk)
        loss = out["q"].sum() + out["sq_dev_sum"].sum() * 0.01 + out["logprobs"].sum()
        grads = torch.autograd.grad(loss, [head.weight])[0]
        return out, grads, hidden.detach()

    small, g_small, hidden = run(chunk=3)
    big, g_big, _ = run(chunk=4096)
    for k in small:
        torch.testing.assert_close(small[k], big[k], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(g_small, g_big, atol=1e-4, rtol=1e-4)
    # Against the full (B, L, V) logits.
    with torch.no_grad():
        logits = head(hidden)
    for b, t in rm.nonzero().tolist():
        full = logits[b, t - 1]
        assert small["q"][b, t].item() == pytest.approx(full[ids[b, t]].item(), abs=1e-4)
        assert small["sq_dev_sum"][b, t].item() == pytest.approx(((full - 0.3) ** 2).sum().item(), rel=1e-5)
        assert small["logprobs"][b, t].item() == pytest.approx(
            torch.log_softmax(full / 0.7, -1)[ids[b, t]].item(), abs=1e-5
        )
        assert small["q_max"][b, t].item() == pytest.approx(full.max().item(), abs=1e-5)
        assert small["logsumexp"][b, t].item() == pytest.approx(torch.logsumexp(full, -1).item(), abs=1e-5)
    nxt = max_q_after_positions(hidden, rm, head, chunk=2)
    for b, t in rm.nonzero().tolist():
        assert nxt[b, t].item() == pytest.approx(logits[b, t].max().item(), abs=1e-5)
    assert not bool(nxt[~rm].any())


def test_conservative_penalty_is_the_mean_over_the_other_actions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, generator=g)
    taken = torch.tensor([4, 0, 10])
    q = logits.gather(1, taken[:, None]).squeeze(1)
    pen = conservative_penalty(((logits - 0.5) ** 2).sum(1), q, 0.5, 11)
    for i in range(3):
        others = torch.cat([logits[i, : taken[i]], logits[i, taken[i] + 1 :]])
        assert pen[i].item() == pytest.approx(0.5 * ((others - 0.5) ** 2).mean().item(), rel=1e-5)
    assert td_loss(torch.tensor([3.0]), torch.tensor([1.0])).item() == 2.0
    # CQL(H): the data token's cross-entropy, unchanged by a shift of every Q of the state.
    lse = torch.logsumexp(logits, 1)
    torch.testing.assert_close(cql_penalty(lse, q), -torch.log_softmax(logits, 1).gather(1, taken[:, None]).squeeze(1))
    torch.testing.assert_close(cql_penalty(torch.logsumexp(logits + 7, 1), q + 7), cql_penalty(lse, q))


# -- the EMA target network ---------------------------------------------------------------------------


def test_ema_moves_by_exactly_one_minus_decay_of_the_gap():
    t, o = [torch.tensor([0.0, 1.0, -2.0])], [torch.tensor([1.0, 3.0, 2.0])]
    gap = o[0] - t[0]
    before = t[0].clone()
    ema_update_(t, o, 0.75)
    torch.testing.assert_close(t[0] - before, 0.25 * gap)


def test_learner_target_follows_the_online_network_by_ema_and_resumes(tiny_model_path, tmp_path):
    hp = {"target_decay": 0.8, "target_start_step": 1, "target_update_every": 2}
    a = make_q_learner(tiny_model_path, train={"lr": 1e-3}, qlearn=hp)
    batch = mdp_batch()
    a.train_step(batch)  # update 1 <= start step: the target copies the online weights
    for t, p in zip(a.target_params, a.trainable):
        torch.testing.assert_close(t, p.detach(), atol=0, rtol=0)
    a.train_step(batch)  # update 2: (2 - 1) % 2 != 0, no EMA step
    assert a.target_updates == 1
    old = [t.clone() for t in a.target_params]
    a.train_step(batch)  # update 3: an EMA step
    assert a.target_updates == 2
    for t, o, p in zip(a.target_params, old, a.trainable):
        torch.testing.assert_close(t - o, 0.2 * (p.detach() - o), atol=1e-6, rtol=1e-5)
    moved = sum(float((t - o).abs().sum()) for t, o in zip(a.target_params, old))
    assert moved > 0
    a.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "target" / "target.safetensors").is_file()
    b = make_q_learner(tiny_model_path, train={"lr": 1e-3}, qlearn=hp, seed=1)
    b.restore(tmp_path / "ckpt")
    assert (b.updates, b.target_updates, b.version) == (3, 2, 3)
    for tb, ta in zip(b.target_params, a.target_params):
        torch.testing.assert_close(tb, ta, atol=0, rtol=0)
    # Exact resume: both take the same next step.
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert ma["loss/td"] == pytest.approx(mb["loss/td"], rel=1e-6)
    assert ma["q/target"] == pytest.approx(mb["q/target"], rel=1e-6)


def test_lora_target_is_an_ema_of_the_adapter_only(tiny_model_path):
    q = make_q_learner(tiny_model_path, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    assert q.target_names and all("lora_" in n for n in q.target_names)
    m = q.train_step(mdp_batch())
    assert math.isfinite(m["loss/td"]) and q.target_updates == 1


def _scored_groups(path):
    lm = tiny_lm(path)
    groups = [0, 0, 0, 1, 1, 2, 2, 2, 3]
    ids, att, rm = grouped_batch(lm.config.vocab_size, groups, seed=4)
    scores = [0.1 * i for i in range(len(groups))]
    truncated = [i % 2 == 0 for i in range(len(groups))]
    return experience(lm, ids, att, rm, scores, groups=groups, truncated=truncated, ref_shift=0.1)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_two_learners_take_the_one_learner_step(tiny_model_path, kl_coef):
    """Each rank's loss is normalised by the global action count and gradients are summed: two
    ranks give one rank's gradient, also over micro-batches and shared-prefix passes."""
    batch = _scored_groups(tiny_model_path)
    hp = {"kl_coef": kl_coef, "n_step": 2, "bootstrap_truncated": True}
    g1, m1 = step_with_grads(
        make_q_learner(tiny_model_path, qlearn=hp, train={"micro_batch_size": 8, "shared_prefix": False}), batch
    )
    learners = [make_q_learner(tiny_model_path, qlearn=hp, train={"micro_batch_size": 2}) for _ in range(2)]
    results = run_ranks(2, lambda rank, comm: step_with_grads(learners[rank], batch, comm))
    for g, m in results:
        torch.testing.assert_close(g["g"], g1["g"], atol=2e-6, rtol=1e-4)
        for key in ("loss/td", "loss/conservative", "loss/kl", "q/target", "policy/grad_norm"):
            assert m[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-7), key
    assert g1["g"].abs().sum() > 0
    assert (m1["loss/kl"] > 1e-4) == (kl_coef > 0)


def test_rewards_logged_after_the_first_eos_go_to_the_last_action(tiny_model_path):
    q = make_q_learner(tiny_model_path)
    # A logged reply that went on past EOS (2): its later rewards are credited to the EOS action.
    batch = transitions_batch([5, 6], [([10, 2, 11, 12], [0.1, 0.2, 0.3, 0.4]), ([10, 11], [0.0, 1.0])])
    mask, rewards, done = q.episodes(batch)
    assert mask.long().tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]]
    torch.testing.assert_close(rewards, torch.tensor([[0, 0, 0.1, 0.9, 0, 0], [0, 0, 0.0, 1.0, 0, 0]]))
    assert done.tolist() == [True, True]
    assert float(rewards.sum()) == pytest.approx(float(batch.token_rewards.sum()))  # nothing lost


def test_a_batch_without_rewards_is_refused(tiny_model_path):
    q = make_q_learner(tiny_model_path)
    ids, att, rm = ragged_batch(512, b=2)
    batch = experience(tiny_lm(tiny_model_path), ids, att, rm, [1.0, 0.0]).replace(scores=None)
    with pytest.raises(ExperienceError, match="scores or token_rewards"):
        q.train_step(batch)


# -- convergence on token MDPs with closed-form optimal values ------------------------------------------
# States: s0 = the prompt; sA = prompt + A; sAC; sB. Rewards as in mdp_batch. With the conservative term
# the Q of tokens outside the data sinks to the floor 0 <= every reward, so max_a Q = the best data action:
#   Q(sAC, EOS) = 1, Q(sA, C) = g, Q(sA, EOS) = 0.3, Q(s0, A) = g * max(g, 0.3), Q(sB, EOS) = 0.5,
#   Q(s0, B) = 0.1 + 0.5 g.
TOL_Q = 0.03


def _q_table(learner, batch):
    """Q of (state row, position) -> the logits of that state."""
    lm = learner.model.lm
    with torch.no_grad():
        h = lm.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).last_hidden_state
        return lm.get_output_embeddings()(h)


def _train(path, batch, steps, **hp):
    q = make_q_learner(
        path, train={"lr": 3e-3, "shared_prefix": False}, qlearn={"mc_lower_bound": False, "target_decay": 0.9, **hp}
    )
    for _ in range(steps):
        m = q.train_step(batch)
    return q, m


@pytest.fixture(scope="module")
def converged(tiny_model_path):
    """The MDP solved with gamma 0.9 and 1.0 (one-step backups) and, for comparison, without the
    conservative term."""
    batch = mdp_batch()
    runs = {g: _train(tiny_model_path, batch, 300, gamma=g) for g in (0.9, 1.0)}
    runs["no_conservative"] = _train(tiny_model_path, batch, 300, gamma=0.9, conservative_weight=0.0)
    return batch, {k: _q_table(q, batch) for k, (q, _) in runs.items()}, {k: m for k, (_, m) in runs.items()}


@pytest.mark.parametrize("gamma", [0.9, 1.0])
def test_q_values_converge_to_the_closed_form_optimum(converged, gamma):
    batch, tables, metrics = converged
    Q = tables[gamma]
    A, B, C, EOS = 10, 11, 12, 2
    s0, sA, sAC, sB = Q[0, 2], Q[0, 3], Q[0, 4], Q[2, 3]
    want = {
        "Q(sAC,EOS)": (sAC[EOS], 1.0),
        "Q(sA,C)": (sA[C], gamma),
        "Q(sA,EOS)": (sA[EOS], 0.3),
        "Q(s0,A)": (s0[A], gamma * max(gamma, 0.3)),
        "Q(sB,EOS)": (sB[EOS], 0.5),
        "Q(s0,B)": (s0[B], 0.1 + 0.5 * gamma),
    }
    for name, (got, expected) in want.items():
        assert float(got) == pytest.approx(expected, abs=TOL_Q), name
    assert metrics[gamma]["loss/td"] < 1e-3
    # The greedy action at the root is the one of the highest optimal value.
    assert int(s0.argmax()) == A


def test_discounting_is_visible_in_the_learned_values(converged):
    _, tables, _ = converged
    # Two tokens before the reward of 1: Q(s0, A) = 0.81 with gamma 0.9, 1 without discounting.
    assert float(tables[1.0][0, 2, 10] - tables[0.9][0, 2, 10]) == pytest.approx(0.19, abs=2 * TOL_Q)


def test_the_conservative_term_lowers_q_of_unseen_actions(converged):
    _, tables, _ = converged
    seen = {(0, 2): [10, 11], (0, 3): [12, 2], (0, 4): [2], (2, 3): [2]}
    for (row, pos), tokens in seen.items():
        unseen = torch.ones(512, dtype=torch.bool)
        unseen[tokens] = False
        with_term = tables[0.9][row, pos][unseen]
        without = tables["no_conservative"][row, pos][unseen]
        assert float(with_term.max()) < float(without.max()) - 1.0
        assert float(with_term.abs().mean()) < float(without.abs().mean())
        assert float(with_term.max()) < 0.3  # below every data action's value: max_a Q picks data actions
    # Without it, unseen tokens' logits leak into max_a Q and the values overshoot the optimum.
    assert float(tables["no_conservative"][0, 2, 10]) > 0.81 + 1.0


def test_the_logsumexp_term_lowers_the_best_unseen_token_relative_to_the_data(tiny_model_path):
    """CQL(H) is shift-invariant: it does not pull Q to a floor, it widens the gap between the data's
    actions and the best token the data never took."""
    batch = mdp_batch()
    unseen = torch.ones(512, dtype=torch.bool)
    unseen[[10, 11]] = False
    gap = {}
    for weight in (0.3, 0.0):
        q, m = _train(tiny_model_path, batch, 60, gamma=0.9, conservative="logsumexp", conservative_weight=weight)
        root = _q_table(q, batch)[0, 2]
        gap[weight] = float(root[unseen].max() - root[[10, 11]].max())
        assert math.isfinite(m["loss/td"]) and m["loss/conservative"] > 0  # measured even at weight 0
    assert gap[0.3] < gap[0.0], gap


def test_n_step_and_one_step_agree_at_convergence(tiny_model_path):
    """An MDP whose branching is at the root only: the data's continuations are the greedy ones,
    so n-step returns and one-step backups share their fixed point (gamma 0.9):
    Q(s0, A) = 0.81, Q(s0, B) = 0.55, Q(s0, D) = 0.2 + 0.9 * (0.1 + 0.9 * 0.2) = 0.452."""
    batch = transitions_batch(
        [5, 6, 7], [([10, 12, 2], [0, 0, 1.0]), ([11, 2], [0.1, 0.5]), ([13, 12, 2], [0.2, 0.1, 0.2])]
    )
    tables = {}
    for n in (1, 3):
        q, _ = _train(tiny_model_path, batch, 300, gamma=0.9, n_step=n)
        tables[n] = _q_table(q, batch)
    for n, Q in tables.items():
        for (row, pos, tok), want in {
            (0, 2, 10): 0.81,
            (0, 2, 11): 0.55,
            (0, 2, 13): 0.452,
            (0, 3, 12): 0.9,
            (2, 3, 12): 0.28,
            (2, 4, 2): 0.2,
        }.items():
            assert float(Q[row, pos, tok]) == pytest.approx(want, abs=TOL_Q), (n, row, pos, tok)
    for row, pos, tok in [(0, 2, 10), (0, 2, 11), (0, 2, 13)]:
        assert float(tables[1][row, pos, tok]) == pytest.approx(float(tables[3][row, pos, tok]), abs=TOL_Q)
