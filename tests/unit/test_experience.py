import pytest
import torch

from learners.experience import Experience, ExperienceError, rows_by_group


def make(b=2, length=5, resp_start=2, nresp=(3, 2)):
    ids = torch.arange(b * length, dtype=torch.long).view(b, length)
    att = torch.zeros(b, length, dtype=torch.bool)
    resp = torch.zeros(b, length, dtype=torch.bool)
    for i, n in enumerate(nresp):
        att[i, : resp_start + n] = True
        resp[i, resp_start : resp_start + n] = True
    return Experience(
        input_ids=ids,
        attention_mask=att,
        response_mask=resp,
        rollout_logprobs=torch.where(resp, -1.0, 0.0),
        group_ids=torch.arange(b),
        truncated=torch.zeros(b, dtype=torch.bool),
        policy_version=3,
        completions=[f"c{i}" for i in range(b)],
        meta=[{"i": i} for i in range(b)],
    )


def test_validate_accepts_good_record():
    exp = make().validate()
    assert exp.response_lengths().tolist() == [3, 2]


@pytest.mark.parametrize(
    "change, msg",
    [
        ({"rollout_logprobs": torch.zeros(2, 4)}, "rollout_logprobs"),
        ({"scores": torch.tensor([1.0, float("nan")])}, "NaN"),
        ({"scores": torch.tensor([1.0])}, "scores"),
        ({"completions": ["only one"]}, "completions"),
        ({"input_ids": torch.zeros(2, 5)}, "int64"),
    ],
)
def test_validate_rejects_inconsistent_fields(change, msg):
    with pytest.raises(ExperienceError, match=msg):
        make().replace(**change).validate()


def test_response_mask_cannot_cover_padding():
    exp = make()
    rm = exp.response_mask.clone()
    rm[1, 4] = True
    with pytest.raises(ExperienceError, match="padding"):
        exp.replace(response_mask=rm).validate()


def test_select_and_concat_keep_rows_aligned():
    a = make()
    b = make(b=1, length=8, nresp=(5,)).replace(policy_version=2, skipped={"truncated": 1})
    both = Experience.concat([a, b], pad_token_id=-7).validate()
    assert both.input_ids.shape == (3, 8)
    assert both.input_ids[0, 5:].tolist() == [-7, -7, -7]
    assert not both.response_mask[0, 5:].any()
    assert both.completions == ["c0", "c1", "c0"]
    assert both.policy_version == 2 and both.skipped == {"truncated": 1}
    sub = both.select([2, 0])
    assert sub.completions == ["c0", "c0"] and sub.input_ids.shape == (2, 8)
    assert torch.equal(sub.input_ids[1, :5], a.input_ids[0])


def test_rows_by_group_keeps_first_appearance_order():
    assert rows_by_group([7, 3, 7, 5, 3]) == [[0, 2], [1, 4], [3]]
    assert rows_by_group(torch.tensor([2, 2]).tolist()) == [[0, 1]] and rows_by_group([]) == []


def test_shard_rows_deal_whole_groups_round_robin_without_padding():
    # Groups in order of first appearance: 4 (rows 0, 2), 9 (rows 1, 3), 7 (row 4).
    exp = make(b=5, nresp=(3, 2, 3, 2, 3)).replace(group_ids=torch.tensor([4, 9, 4, 9, 7]))
    shards = [exp.shard_rows(r, 2) for r in range(2)]
    assert shards == [[0, 2, 4], [1, 3]]
    assert exp.select(shards[0]).group_ids.tolist() == [4, 4, 7]
    # No padding rows: sizes differ, and every row is on exactly one rank.
    assert exp.select(shards[1]).group_ids.tolist() == [9, 9] and exp.select(shards[1]).batch_size == 2
    assert sorted(shards[0] + shards[1]) == list(range(5))
    assert exp.shard_rows(0, 1) == list(range(5))
    # More ranks than groups: the extra ranks get nothing, nobody gets a row twice.
    four = [exp.shard_rows(r, 4) for r in range(4)]
    assert four == [[0, 2], [1, 3], [4], []]
    # The deal is a fixed function of the batch (every rank computes the same split).
    assert [exp.shard_rows(r, 2) for r in range(2)] == shards


def test_trimmed_drops_only_all_padding_columns():
    from learners.experience import Experience

    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 0, 0, 0]])
    att = ids != 0
    rm = torch.tensor([[False, True, True, False, False], [False, True, False, False, False]])
    exp = Experience(
        ids,
        att,
        rm,
        rm.float() * -1.0,
        torch.arange(2),
        torch.zeros(2, dtype=torch.bool),
        0,
        ["a", "b"],
        [{}, {}],
        scores=torch.ones(2),
    )
    t = exp.trimmed()
    assert t.seq_len == 3 and t.batch_size == 2
    assert torch.equal(t.input_ids, ids[:, :3]) and torch.equal(t.response_mask, rm[:, :3])
    assert torch.equal(t.rollout_logprobs, exp.rollout_logprobs[:, :3]) and torch.equal(t.scores, exp.scores)
    t.validate()
    assert exp.select([1]).trimmed().seq_len == 2


def test_token_versions_are_checked_against_the_policy_version_and_concat_fills_them():
    """Per-token versions (in-flight weight updates): never older than the record's policy_version
    (its oldest tokens'); a record without them, concatenated with one that has them, gets its
    own policy_version at its response tokens."""
    mixed = make()
    versions = torch.where(mixed.response_mask, 3, 0)
    versions[0, 4] = 4  # the last token of row 0 sampled after a load landed
    mixed = mixed.replace(token_versions=versions).validate()
    with pytest.raises(ExperienceError, match="older than"):
        mixed.replace(token_versions=torch.where(mixed.response_mask, 2, 0)).validate()
    with pytest.raises(ExperienceError, match="int64"):
        mixed.replace(token_versions=versions.float()).validate()
    plain = make(length=6).replace(policy_version=5)
    both = Experience.concat([mixed, plain]).validate()
    assert both.policy_version == 3 and both.token_versions.shape == (4, 6)
    assert both.token_versions[0].tolist() == [0, 0, 3, 3, 4, 0]
    assert both.token_versions[2].tolist() == [0, 0, 5, 5, 5, 0]
    assert Experience.concat([make(), plain]).token_versions is None
    assert both.select([1, 0]).token_versions[1].tolist() == [0, 0, 3, 3, 4, 0]
