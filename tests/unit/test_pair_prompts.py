"""Which prompts generated preference pairs come from (cluster/recipes/pairs.py, cluster/driver.py):
each iteration of a staged run draws prompts the earlier iterations did not, and a pair target
draws more prompts until it is met or the prompt budget is spent, counted. A stand-in generator
pool (no Ray): even rows' candidates differ in score, odd rows' tie."""

import json
import types

import pytest
import torch

from cluster.config.loading import load_config
from cluster.driver import with_prompt_offset
from cluster.recipes import pairs
from cluster.data.prompts import PromptSampler
from learners.experience import Experience

ROWS = [{"prompt": f"q{i}", "meta": {}, "id": i} for i in range(40)]


class StandInRollout:
    """Two candidates per prompt; the scorer ranks an even row's apart and ties an odd row's."""

    def __init__(self) -> None:
        self.drawn: list[list[int]] = []

    def generate_checked(self, rows, uids, seed=None):
        self.drawn.append([r["id"] for r in rows])
        b = 2 * len(rows)
        exp = Experience(
            input_ids=torch.ones(b, 4, dtype=torch.long),
            attention_mask=torch.ones(b, 4, dtype=torch.bool),
            response_mask=torch.tensor([[False, False, True, True]] * b),
            rollout_logprobs=torch.zeros(b, 4),
            group_ids=torch.tensor([u for u in uids for _ in range(2)]),
            truncated=torch.zeros(b, dtype=torch.bool),
            policy_version=0,
            completions=[f"{r['id']}{c}" for r in rows for c in "ab"],
            meta=[{"id": r["id"]} for r in rows for _ in range(2)],
        )
        return [exp], [{"seconds": 0.0}]

    def score_checked(self, exp_refs):
        exp = exp_refs[0]
        scores = [
            (1.0 if c == "a" else 0.0) if m["id"] % 2 == 0 else 0.5
            for c, m in zip((c[-1] for c in exp.completions), exp.meta)
        ]
        return [exp.replace(scores=torch.tensor(scores))], [{"seconds": 0.0}]


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr(pairs, "ray", types.SimpleNamespace(get=lambda x: x))


def _ctx(tmp_path, *overrides):
    cfg = load_config(overrides=["dpo.candidates=2", "dpo.pair_prompts=4", *overrides])
    return types.SimpleNamespace(cfg=cfg, dir=tmp_path)


def test_a_pair_target_draws_more_prompts_until_it_is_met(tmp_path):
    ctx, rollout = _ctx(tmp_path, "dpo.target_pairs=5", "dpo.max_pair_prompts=40"), StandInRollout()
    made, counts = pairs.ranked_pairs(ctx, rollout, ROWS, by="scorer")
    # A naive replay of the rule over the same prompt stream: draw 4, count the even rows, stop at 5.
    stream, expected, formed = PromptSampler(len(ROWS), 4, ctx.cfg.run.seed + 1), [], 0
    while formed < 5:
        expected.append(stream.next())
        formed += sum(1 for i in expected[-1] if i % 2 == 0)
    assert rollout.drawn == expected and len(expected) > 1
    assert counts["pairs"] == formed == made.batch_size // 2 and counts["prompts"] == 4 * len(expected)
    assert counts["draws"] == len(expected) and counts["shortfall"] == 0 and counts["target_pairs"] == 5
    assert counts["no_pair_tie"] == counts["prompts"] - formed
    table = json.loads((tmp_path / pairs.PAIRS_COUNTS).read_text())
    assert table == counts
    # Group ids stay unique across draws (a prompt's uid in the stream), so the pairs split cleanly.
    assert len(set(made.group_ids.tolist())) == formed


def test_a_pair_target_stops_at_its_prompt_budget_and_counts_the_shortfall(tmp_path):
    ctx, rollout = _ctx(tmp_path, "dpo.target_pairs=100", "dpo.max_pair_prompts=12"), StandInRollout()
    _, counts = pairs.ranked_pairs(ctx, rollout, ROWS, by="scorer")
    assert len(rollout.drawn) == 3 and counts["prompts"] == 12
    assert counts["shortfall"] == 100 - counts["pairs"] > 0


def test_without_a_target_one_draw(tmp_path):
    rollout = StandInRollout()
    pairs.ranked_pairs(_ctx(tmp_path), rollout, ROWS, by="scorer")
    assert len(rollout.drawn) == 1


def test_each_iteration_of_a_staged_run_draws_new_prompts(tmp_path):
    first = load_config(overrides=["run.algorithm=dpo", "dpo.pairs=self_judge", "dpo.pair_prompts=8"])
    (tmp_path / "00-first" / "data").mkdir(parents=True)
    (tmp_path / "00-first" / "data" / "pairs_counts.json").write_text(json.dumps({"prompts": 8}))
    second = load_config(overrides=["run.algorithm=dpo", "dpo.pairs=spin", "dpo.pair_prompts=8"])
    offset = with_prompt_offset(second, [(tmp_path / "00-first", first)]).dpo.prompt_offset
    assert offset == 8
    drawn = [
        set(pairs.prompt_stream(c, len(ROWS)).next())
        for c in (first, second.model_copy(update={"dpo": second.dpo.model_copy(update={"prompt_offset": offset})}))
    ]
    assert len(drawn[0]) == len(drawn[1]) == 8 and not drawn[0] & drawn[1]
    # Off: every iteration draws the same prompts; a preference file draws none.
    same = load_config(overrides=["run.algorithm=dpo", "dpo.pairs=spin", "dpo.fresh_prompts=false"])
    assert with_prompt_offset(same, [(tmp_path / "00-first", first)]).dpo.prompt_offset == 0
    from_file = load_config(overrides=["run.algorithm=dpo", "data.preference_file=p.jsonl"])
    assert with_prompt_offset(from_file, [(tmp_path / "00-first", first)]).dpo.prompt_offset == 0
