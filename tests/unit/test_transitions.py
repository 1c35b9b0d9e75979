"""Offline Q-learning transitions: Experience -> Parquet -> Experience keeps tokens, masks,
per-token rewards, done and versions; every unusable row is counted by reason; the replay buffer
evicts FIFO and samples deterministically per (seed, step), rows or whole groups."""

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from actors.data.replay import ReplayBuffer
from actors.data.transitions import (
    TRANSITION_SCHEMA,
    Transition,
    TransitionsError,
    export_experience,
    read_transitions,
    transitions_from_experience,
    transitions_to_experience,
    write_transitions,
)
from learners.experience import Experience

PAD = 0


def make_exp(token_rewards: bool, version: int = 4) -> Experience:
    """Three rows: prompts of 2/3/2 tokens, responses of 3/1/0 tokens (row 2 is empty)."""
    seqs = [([5, 6], [7, 8, 9]), ([10, 11, 12], [13]), ([14, 15], [])]
    length = 6
    ids = torch.full((3, length), PAD, dtype=torch.long)
    att = torch.zeros(3, length, dtype=torch.bool)
    resp = torch.zeros_like(att)
    for i, (p, r) in enumerate(seqs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        att[i, : len(p) + len(r)] = True
        resp[i, len(p) : len(p) + len(r)] = True
    lp = torch.where(resp, -0.5 - torch.arange(length).float() / 10, 0.0)
    tr = torch.where(resp, torch.arange(length).float() + 0.25, 0.0) if token_rewards else None
    return Experience(
        input_ids=ids,
        attention_mask=att,
        response_mask=resp,
        rollout_logprobs=lp,
        group_ids=torch.tensor([3, 3, 8]),
        truncated=torch.tensor([False, True, False]),
        policy_version=version,
        completions=["a", "b", "c"],
        meta=[{"q": i} for i in range(3)],
        scores=torch.tensor([1.0, -2.0, 0.5]),
        token_rewards=tr,
    ).validate()


@pytest.mark.parametrize("token_rewards", [True, False])
def test_round_trip_through_parquet(tmp_path, token_rewards):
    exp = make_exp(token_rewards)
    report = export_experience(exp, tmp_path / "sub" / "t.parquet")
    assert report == {"rows": 2, "skipped": {"empty_response": 1}}
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["t.parquet"]  # no temp file left
    rows, skipped = read_transitions(tmp_path / "sub" / "t.parquet", vocab_size=16)
    assert skipped == {}
    assert [(t.prompt_ids, t.response_ids) for t in rows] == [([5, 6], [7, 8, 9]), ([10, 11, 12], [13])]
    assert [t.done for t in rows] == [True, False]
    assert [t.meta for t in rows] == [{"q": 0}, {"q": 1}]
    if token_rewards:
        assert rows[0].rewards == pytest.approx([2.25, 3.25, 4.25]) and rows[1].rewards == pytest.approx([3.25])
    else:  # the score sits at the last response token
        assert rows[0].rewards == [0.0, 0.0, 1.0] and rows[1].rewards == [-2.0]
    assert rows[0].behaviour_logprobs == pytest.approx([-0.7, -0.8, -0.9])

    back = transitions_to_experience(rows, pad_token_id=PAD)
    kept = exp.select([0, 1]).trimmed()
    assert torch.equal(back.input_ids, kept.input_ids)
    assert torch.equal(back.attention_mask, kept.attention_mask)
    assert torch.equal(back.response_mask, kept.response_mask)
    assert torch.allclose(back.rollout_logprobs, kept.rollout_logprobs)
    assert torch.equal(back.truncated, kept.truncated)
    assert back.group_ids.tolist() == [3, 3] and back.policy_version == 4
    assert back.completions == ["a", "b"] and back.meta == [{"q": 0}, {"q": 1}]
    expected = kept.token_rewards if token_rewards else torch.tensor([[0, 0, 0, 0, 1.0], [0, 0, 0, -2.0, 0]])
    assert torch.allclose(back.token_rewards, expected)
    assert torch.allclose(back.scores, expected.sum(1))
    assert back.scores.dtype == torch.float32


def test_export_needs_rewards():
    exp = make_exp(token_rewards=False).replace(scores=None)
    with pytest.raises(ValueError, match="neither token_rewards nor scores"):
        transitions_from_experience(exp)


def test_a_multi_turn_row_keeps_its_observations_as_no_actions(tmp_path):
    """Prompt, turn 1, an observation, turn 2: the exported row holds every token after the
    prompt, the observation marked as no action, the score at the last action; read back it is
    the same record."""
    ids = torch.tensor([[5, 6, 7, 8, 20, 21, 9, 10, PAD]])
    att = torch.tensor([[True] * 8 + [False]])
    resp = torch.tensor([[False, False, True, True, False, False, True, True, False]])
    lp = torch.where(resp, torch.tensor(-0.25), torch.tensor(0.0))
    exp = Experience(
        input_ids=ids,
        attention_mask=att,
        response_mask=resp,
        rollout_logprobs=lp,
        group_ids=torch.tensor([1]),
        truncated=torch.tensor([False]),
        policy_version=2,
        completions=["t"],
        meta=[{}],
        scores=torch.tensor([0.75]),
    ).validate()
    rows, skipped = transitions_from_experience(exp)
    assert not skipped and rows[0].prompt_ids == [5, 6] and rows[0].response_ids == [7, 8, 20, 21, 9, 10]
    assert rows[0].action_mask == [True, True, False, False, True, True]
    assert rows[0].rewards == [0, 0, 0, 0, 0, 0.75]
    write_transitions(rows, tmp_path / "t.parquet")
    back = transitions_to_experience(read_transitions(tmp_path / "t.parquet")[0], pad_token_id=PAD)
    kept = exp.trimmed()
    assert torch.equal(back.input_ids, kept.input_ids) and torch.equal(back.response_mask, kept.response_mask)
    assert torch.equal(back.rollout_logprobs, kept.rollout_logprobs) and float(back.scores[0]) == 0.75


def _t(version: int, group: int, done: bool = True, logprobs: bool = True) -> Transition:
    return Transition(
        [1, 2], [3, 4], [0.0, 1.0], done, version, [-1.0, -2.0] if logprobs else None, group, f"c{group}", {"g": group}
    )


def test_directory_is_read_in_file_name_order(tmp_path):
    write_transitions([_t(2, 20), _t(3, 21)], tmp_path / "b.parquet")
    write_transitions([_t(1, 10)], tmp_path / "a.parquet")
    (tmp_path / "notes.txt").write_text("not parquet")
    rows, skipped = read_transitions(tmp_path)
    assert [t.group_id for t in rows] == [10, 20, 21] and skipped == {}
    exp = transitions_to_experience(rows + [_t(5, 30, done=False, logprobs=False)], pad_token_id=PAD)
    assert exp.policy_version == 1  # the stalest row
    assert exp.truncated.tolist() == [False, False, False, True]
    assert exp.rollout_logprobs[3].tolist() == [0.0] * 4  # no logprobs -> zeros
    short = transitions_to_experience(rows + [Transition([1] * 5, [2], [1.0], True, 0, None, 9)], PAD, max_len=4)
    assert short.batch_size == 3 and short.skipped == {"too_long": 1}
    with pytest.raises(ValueError, match="zero transitions"):
        transitions_to_experience([], PAD)
    with pytest.raises(FileNotFoundError, match="not found"):
        read_transitions(tmp_path / "missing")


GOOD = dict(
    prompt_ids=[1, 2],
    response_ids=[3, 4],
    rewards=[0.0, 1.0],
    done=True,
    behaviour_version=7,
    behaviour_logprobs=[-1.0, -1.0],
    group_id=0,
    completion="ok",
    meta='{"a": 1}',
)
BAD = [
    ({"rewards": [1.0]}, "length_mismatch"),
    ({"behaviour_logprobs": [-1.0]}, "length_mismatch"),
    ({"rewards": [0.0, math.nan]}, "nan_reward"),
    ({"rewards": [math.inf, 0.0]}, "nan_reward"),
    ({"response_ids": [], "rewards": [], "behaviour_logprobs": []}, "empty_response"),
    ({"prompt_ids": []}, "empty_prompt"),
    ({"response_ids": [3, 99]}, "token_out_of_range"),
    ({"prompt_ids": [-1, 2]}, "token_out_of_range"),
    ({"meta": "{not json"}, "bad_meta"),
    ({"meta": "[1, 2]"}, "bad_meta"),
    ({"behaviour_logprobs": [-1.0, math.nan]}, "nan_logprob"),
    ({"done": None}, "null_field"),
]


def test_bad_rows_are_counted_and_excluded(tmp_path):
    good = [
        {**GOOD, "group_id": 1},
        {**GOOD, "group_id": 2, "meta": None, "behaviour_logprobs": None},
        {**GOOD, "group_id": 3, "meta": ""},
    ]
    bad = [{**GOOD, **change, "group_id": 100 + i} for i, (change, _) in enumerate(BAD)]
    pq.write_table(pa.Table.from_pylist(good[:1] + bad + good[1:], schema=TRANSITION_SCHEMA), tmp_path / "x.parquet")
    rows, skipped = read_transitions(tmp_path / "x.parquet", vocab_size=50)
    expected: dict[str, int] = {}
    for _, reason in BAD:
        expected[reason] = expected.get(reason, 0) + 1
    assert skipped == expected
    assert [t.group_id for t in rows] == [1, 2, 3]
    assert [t.meta for t in rows] == [{"a": 1}, {}, {}]
    assert rows[1].behaviour_logprobs is None
    # Without a vocabulary size only negative ids are out of range.
    _, skipped = read_transitions(tmp_path / "x.parquet")
    assert skipped["token_out_of_range"] == 1


def test_missing_column_is_an_error(tmp_path):
    table = pa.Table.from_pylist([GOOD], schema=TRANSITION_SCHEMA).drop_columns(["rewards", "done"])
    pq.write_table(table, tmp_path / "x.parquet")
    with pytest.raises(TransitionsError, match=r"x\.parquet.*rewards, done"):
        read_transitions(tmp_path)
    # Optional columns may be absent.
    table = pa.Table.from_pylist([GOOD], schema=TRANSITION_SCHEMA).drop_columns(["behaviour_logprobs", "meta"])
    pq.write_table(table, tmp_path / "x.parquet")
    rows, skipped = read_transitions(tmp_path)
    assert len(rows) == 1 and rows[0].behaviour_logprobs is None and rows[0].meta == {} and skipped == {}


def test_replay_buffer_evicts_oldest_first():
    buf = ReplayBuffer(capacity=4)
    assert buf.add([_t(v, v) for v in range(3)]) == 0
    assert buf.add([_t(v, v) for v in range(3, 6)]) == 2
    assert len(buf) == 4 and sorted(t.group_id for t in buf.sample(4, step=0)) == [2, 3, 4, 5]
    assert buf.add([_t(v, v) for v in range(6, 12)]) == 6  # more than capacity: own first rows go too
    assert sorted(t.group_id for t in buf.sample(4, step=0)) == [8, 9, 10, 11]
    assert buf.stats() == {"size": 4, "capacity": 4, "added": 12, "evicted": 8, "mean_behaviour_version": 9.5}


def test_replay_buffer_sampling_is_deterministic():
    def filled(seed):
        buf = ReplayBuffer(capacity=100, seed=seed)
        buf.add([_t(0, g) for g in range(50)])
        return buf

    ids = lambda rows: [t.group_id for t in rows]  # noqa: E731
    a, b = filled(0), filled(0)
    assert ids(a.sample(10, step=3)) == ids(b.sample(10, step=3))  # same (contents, seed, step)
    assert ids(a.sample(10, step=3)) != ids(a.sample(10, step=4))
    assert ids(a.sample(10, step=3)) != ids(filled(1).sample(10, step=3))
    for step in range(20):  # without replacement when n <= len: no duplicates, even n == len
        assert len(set(ids(a.sample(50, step=step)))) == 50
    many = ids(a.sample(200, step=0))  # with replacement beyond len
    assert len(many) == 200 and set(many) <= set(range(50)) and len(set(many)) < 200
    with pytest.raises(ValueError, match="empty replay buffer"):
        ReplayBuffer(capacity=3).sample(1, step=0)
    assert ReplayBuffer(capacity=3).stats()["mean_behaviour_version"] is None


def test_replay_buffer_samples_whole_groups_for_a_group_baseline():
    """whole_groups (qlearn.reward_baseline=group_mean): a batch holds every row of each group it
    touches, as many groups as fit in n rows (at least one, none twice), deterministically per
    (seed, step); a buffer larger than the batch no longer splits a prompt's samples."""

    def filled(seed=0, sizes=(4, 4, 3, 4, 1, 4)):
        buf = ReplayBuffer(capacity=100, seed=seed, whole_groups=True)
        buf.add([_t(0, g) for g, k in enumerate(sizes) for _ in range(k)])
        return buf

    def groups(rows):
        out = {}
        for t in rows:
            out[t.group_id] = out.get(t.group_id, 0) + 1
        return out

    sizes = dict(enumerate((4, 4, 3, 4, 1, 4)))
    buf = filled()
    for step in range(30):
        rows = buf.sample(9, step)
        got = groups(rows)
        assert all(got[g] == sizes[g] for g in got), got  # every touched group whole, once
        assert len(rows) <= 9
        assert all(len(rows) + k > 9 for g, k in sizes.items() if g not in got)  # none of the rest fits
    assert [t.group_id for t in buf.sample(9, 3)] == [t.group_id for t in filled().sample(9, 3)]
    assert any(groups(buf.sample(9, 3)) != groups(buf.sample(9, s)) for s in range(4, 10))
    assert len(buf.sample(2, 0)) in (1, 3, 4)  # at least one group, even one larger than n
    assert groups(buf.sample(100, 0)) == sizes  # n beyond the buffer: every row once, no duplicates
    assert buf.sample(0, 0) == []
    with pytest.raises(ValueError, match="empty replay buffer"):
        ReplayBuffer(capacity=3, whole_groups=True).sample(1, step=0)
    from cluster.roles.workers import ReplayWorker  # the actor Q-learning samples from passes it on

    worker = ReplayWorker(capacity=100, seed=0, pad_token_id=0, whole_groups=True)
    worker.add_rows(filled().sample(100, 0))
    assert worker.sample(9, step=3).group_ids.tolist() == [t.group_id for t in worker.buffer.sample(9, 3)]
    assert all(
        groups(worker.buffer.sample(9, s))[g] == sizes[g] for s in range(5) for g in groups(worker.buffer.sample(9, s))
    )


def test_replay_worker_refills_the_exported_steps_up_to_the_checkpoint(tmp_path):
    """A resumed online run rebuilds its buffer from <run>/data/transitions/step-*.parquet: the
    steps up to its checkpoint, in order, with the same evictions as the interrupted run."""
    from cluster.roles.workers import ReplayWorker

    def rows(step):
        return [
            Transition(
                prompt_ids=[1, 2],
                response_ids=[3, step],
                rewards=[0.0, float(step)],
                done=True,
                behaviour_version=step,
                behaviour_logprobs=None,
                group_id=step * 10 + i,
            )
            for i in range(3)
        ]

    for step in (1, 2, 3, 4):
        write_transitions(rows(step), tmp_path / f"step-{step:06d}.parquet")
    uninterrupted = ReplayBuffer(capacity=7, seed=5)
    for step in (1, 2, 3):
        uninterrupted.add(rows(step))
    worker = ReplayWorker(capacity=7, seed=5, pad_token_id=0)
    (tmp_path / "step-notes.parquet").write_text("not a step file")  # other names are left alone
    stats = worker.refill(str(tmp_path), upto_step=3)  # step 4 came after the checkpoint: not replayed
    assert stats["files"] == 3 and stats["size"] == 7 and stats["evicted"] == 2
    # ... and removed: the resumed run takes step 4 again and writes it anew.
    assert stats["removed_after_checkpoint"] == 1 and not (tmp_path / "step-000004.parquet").exists()
    assert (tmp_path / "step-notes.parquet").exists()
    assert [t.group_id for t in worker.buffer.sample(7, step=4)] == [
        t.group_id for t in uninterrupted.sample(7, step=4)
    ]
    batch = worker.sample(4, step=4)
    assert batch.batch_size == 4 and batch.token_rewards is not None


def test_offline_split_holds_out_whole_prompts():
    from cluster.recipes.qlearn import split_by_group

    rows = [
        Transition(
            prompt_ids=[1],
            response_ids=[2],
            rewards=[0.0],
            done=True,
            behaviour_version=0,
            behaviour_logprobs=None,
            group_id=i // 4,
        )
        for i in range(40)
    ]  # 10 prompts x 4 samples
    train, held = split_by_group(rows, 6, seed=0)
    assert len(held) == 8 and len(train) == 32  # two whole prompts
    assert not {t.group_id for t in train} & {t.group_id for t in held}
    assert split_by_group(rows, 6, seed=0)[1] == held  # seeded


def test_the_q_recipe_samples_whole_prompts_exactly_for_a_per_prompt_baseline():
    from cluster.config import Config
    from cluster.recipes.qlearn import whole_prompts

    assert whole_prompts(Config.model_validate({"qlearn": {"reward_baseline": "group_mean"}}))
    assert not any(
        whole_prompts(Config.model_validate({"qlearn": {"reward_baseline": b}})) for b in ("none", "batch_mean")
    )
