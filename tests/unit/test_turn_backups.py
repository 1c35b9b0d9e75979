"""Token-level Q-learning across turns: observation tokens are no actions; the backup of a turn's
last action bootstraps from the state before the next turn's first action (the logits at the
observation's last token); each turn ends at its own EOS. Hand values and a naive loop."""

import torch

from learners.objectives.advantages import bootstrap_positions, episode_mask, q_learning_targets

EOS = 2


def test_each_turn_ends_at_its_own_eos():
    #                     prompt | turn 1: a EOS x | obs   | turn 2: b EOS | pad
    ids = torch.tensor([[9, 9, 5, EOS, 7, 8, 8, 6, EOS, 0]])
    resp = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    mask, ended = episode_mask(ids, resp, [EOS])
    # Turn 1's token after its EOS is cut; turn 2 starts again after the observation.
    assert mask.int().tolist() == [[0, 0, 1, 1, 0, 0, 0, 1, 1, 0]] and ended.tolist() == [True]
    resp2 = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 0, 0]], dtype=torch.bool)  # turn 2 cut before its EOS
    assert episode_mask(ids, resp2, [EOS])[1].tolist() == [False]


def test_hand_values_across_an_observation():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0, 0, 0, 0, 0, 0, 1.0, 0]])
    next_q = torch.tensor([[0, 10, 20, 30, 40, 50, 60, 70.0]])
    y = q_learning_targets(rewards, next_q, mask, torch.tensor([True]), gamma=0.5)
    # Position 2 (turn 1's last action) bootstraps from position 4 (the observation's last token).
    assert y.tolist() == [[0, 0.5 * 10, 0.5 * 40, 0, 0, 0.5 * 50, 1.0, 0]]
    assert bootstrap_positions(mask).int().tolist() == [[0, 1, 1, 0, 1, 1, 1, 0]]


def _naive(r, nq, mask, done, n, gamma, mc):
    out = torch.zeros_like(r)
    for b in range(r.shape[0]):
        p = mask[b].nonzero().flatten().tolist()
        last = len(p) - 1
        for i in range(len(p)):
            j = min(n, last - i + 1)
            y = sum(gamma**k * float(r[b, p[i + k]]) for k in range(j))
            tail = i + j - 1
            boot = float(nq[b, p[tail + 1] - 1]) if tail < last else (0.0 if done[b] else float(nq[b, p[last]]))
            y += gamma**j * boot
            if mc:
                y = max(y, sum(gamma ** (k - i) * float(r[b, p[k]]) for k in range(i, last + 1)))
            out[b, p[i]] = y
    return out


def test_targets_match_a_naive_loop_over_turns():
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(4, 14, dtype=torch.bool)
    mask[0, 2:5] = mask[0, 7:10] = True
    mask[1, 1:4] = mask[1, 5:6] = mask[1, 8:12] = True
    mask[2, 3:9] = True  # one turn: the single-reply case
    mask[3, 1:2] = mask[3, 4:5] = True
    r = torch.randn(4, 14, generator=g) * mask
    nq = torch.randn(4, 14, generator=g)
    done = torch.tensor([True, False, True, False])
    for n in (1, 2, 5):
        for gamma in (1.0, 0.9):
            for mc in (False, True):
                got = q_learning_targets(r, nq, mask, done, gamma=gamma, n_step=n, mc_lower_bound=mc)
                assert torch.allclose(got, _naive(r, nq, mask, done, n, gamma, mc), atol=1e-5), (n, gamma, mc)
