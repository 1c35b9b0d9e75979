"""The routes a rollout row carries (``actors/rollout/records.py``): padded to the row, shared by
a prompt's samples, and for multi-turn rows taken from the first engine call that computed each
position, with the observations left to the learner (``OBSERVED``)."""

from __future__ import annotations

import torch

from actors.rollout.records import OBSERVED, padded_routes, row_routes, share_group_prompt_routes, Sampled


def _r(values: list[int]) -> torch.Tensor:
    """One layer, top-1: a route per position."""
    return torch.tensor(values, dtype=torch.int16)[:, None, None]


def test_a_reply_routes_are_padded_to_the_row_with_none_for_its_last_token():
    assert padded_routes(None, 4) is None
    assert padded_routes(_r([3, 1, 2]), 4)[:, 0, 0].tolist() == [3, 1, 2, -1]


def test_each_position_takes_the_route_of_the_first_call_that_computed_it():
    # Prompt of 2; turn 1 samples 2 tokens; an observation of 2; turn 2 samples 2 tokens.
    action = [True, True, False, False, True, True]
    first = _r([5, 6, 7])  # the prompt and turn 1's first token (its last one is not computed)
    # Turn 2: the cache served positions 0-1; position 2 again (recomputed: a different route,
    # which must not replace turn 1's); position 3 (turn 1's last token) and the observation first.
    second = _r([-1, -1, 0, 2, 3, 4, 1])
    got = row_routes([first, None, second], prompt_len=2, action=action)[:, 0, 0].tolist()
    assert got == [5, 6, 7, 2, OBSERVED, OBSERVED, 1, -1]
    assert row_routes([None, None], 2, action) is None


def test_a_position_counts_as_computed_only_when_all_its_slots_are():
    k2 = torch.tensor([[[1, -1]], [[2, 3]]], dtype=torch.int16)  # (2 positions, 1 layer, k=2)
    later = torch.tensor([[[4, 5]], [[6, 7]]], dtype=torch.int16)
    got = row_routes([k2, later], prompt_len=1, action=[True])
    assert got[:, 0].tolist() == [[4, 5], [2, 3]]


def test_rows_of_one_prompt_share_its_routes_and_other_prompts_do_not():
    def row(prompt, group, routes):
        return Sampled(prompt, [9], [0.0], False, "", {}, group, [None], None, routes)

    a = row([1, 2], 0, _r([-1, -1, 4]))
    b = row([1, 2], 0, _r([7, 8, 5]))
    c = row([1, 2], 1, _r([-1, 3, 6]))  # another group: not shared
    share_group_prompt_routes([a, b, c])
    assert a.routes[:, 0, 0].tolist() == [7, 8, 4] and c.routes[:, 0, 0].tolist() == [-1, 3, 6]
