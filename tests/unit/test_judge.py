"""LLM-as-a-judge: prompt filling, score parsing, counting and aggregation (no Ray, no vLLM)."""

import math

import pytest
import torch

from actors.rewards.judge import DEFAULT_TEMPLATE, Judge, JudgeConfig, aggregate, judge_prompt, parse_score
from learners.experience import Experience

PAT = JudgeConfig().score_pattern


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("The reply is relevant and correct.\nScore: 4", (4.0, "parsed")),
        ("Score: 2 ... on reflection, Score: 3", (3.0, "parsed")),  # the last verdict counts
        ("Score:5", (5.0, "parsed")),
        ("Score: 2.5", (2.5, "parsed")),
        ("", (None, "unparsed")),  # an empty reply
        ("I would give it four points.", (None, "unparsed")),
        ("Score: 11", (None, "out_of_range")),  # 11 on a 5-point scale
        ("Score: -1", (None, "out_of_range")),
    ],
)
def test_parse_score(reply, expected):
    assert parse_score(reply, PAT, 0, 5) == expected


def test_custom_pattern_and_scale():
    assert parse_score("Rating [[7]]", r"\[\[(\d+)\]\]", 1, 10) == (7.0, "parsed")
    assert parse_score("Rating [[0]]", r"\[\[(\d+)\]\]", 1, 10) == (None, "out_of_range")


def test_template_filled_literally():
    text = judge_prompt(DEFAULT_TEMPLATE, "What is {x}?", "It is {y}.")
    assert "User: What is {x}?" in text and "<response>It is {y}.</response>" in text
    assert "{prompt}" not in text and "{response}" not in text
    assert "Score: <total points>" in text


def test_aggregate_counts_add_up_and_means():
    cfg = JudgeConfig()
    replies = [
        ["Score: 4", "Score: 2", ""],  # mean of the valid ones: 3
        ["Score: 11", "no verdict", "Score: 5"],  # 5
        ["", "Score: 9", "nothing"],  # no valid judgement -> NaN
        [],
    ]  # never judged (prompt too long)
    scores, counts = aggregate(replies, cfg)
    assert scores[:2] == [3.0, 5.0] and math.isnan(scores[2]) and math.isnan(scores[3])
    assert counts["judgements"] == 9
    assert (counts["parsed"], counts["unparsed"], counts["out_of_range"]) == (3, 4, 2)
    assert counts["parsed"] + counts["unparsed"] + counts["out_of_range"] == counts["judgements"]
    assert (counts["items"], counts["items_scored"], counts["items_unscored"]) == (4, 2, 2)


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"template": "Rate {response}"}, "{prompt}"),
        ({"score_pattern": "Score: \\d+"}, "capturing group"),
        ({"score_pattern": "Score: (\\d+"}, "regular expression"),
        ({"min_score": 5, "max_score": 5}, "below"),
    ],
)
def test_bad_judge_config(kw, msg):
    with pytest.raises(ValueError, match=msg):
        JudgeConfig(**kw)


class FakeEngine:
    """Stands in for ``actors.rollout.generator.Generator``: k canned replies per judge prompt, and
    skips prompts over the budget the way the generator does (a ValueError when none is left)."""

    def __init__(self, replies_by_response):
        self.replies = replies_by_response
        self.calls = []

    def generate(
        self,
        prompts,
        meta,
        group_ids,
        *,
        max_new_tokens,
        max_prompt_tokens,
        temperature,
        n,
        seed=None,
        top_p=1.0,
        top_k=0,
    ):
        self.calls.append(dict(n=n, temperature=temperature, max_new_tokens=max_new_tokens, top_p=top_p, top_k=top_k))
        rows, completions = [], []
        for text, m in zip(prompts, meta):
            if len(text) > max_prompt_tokens:
                continue
            key = text.split("<response>")[1].split("</response>")[0]
            for r in self.replies[key][:n]:
                rows.append(m)
                completions.append(r)
        if not rows:
            raise ValueError("no usable prompt")
        e = Experience(
            input_ids=torch.ones(len(rows), 2, dtype=torch.long),
            attention_mask=torch.ones(len(rows), 2, dtype=torch.bool),
            response_mask=torch.ones(len(rows), 2, dtype=torch.bool),
            rollout_logprobs=torch.zeros(len(rows), 2),
            group_ids=torch.arange(len(rows)),
            truncated=torch.zeros(len(rows), dtype=torch.bool),
            policy_version=0,
            completions=completions,
            meta=rows,
        )
        return e


def test_judge_runs_k_samples_per_item_and_counts_too_long():
    cfg = JudgeConfig(samples=3, temperature=0.7, max_prompt_tokens=len(DEFAULT_TEMPLATE) + 200)
    engine = FakeEngine({"A": ["Score: 5", "Score: 4", "Score: 3"], "B": ["", "Score: 11", "Score: 1"]})
    scores, counts, replies = Judge(cfg).judge(engine, ["q1", "q2", "q3"], ["A", "B", "x" * 400])
    assert engine.calls == [dict(n=3, temperature=0.7, max_new_tokens=cfg.max_new_tokens, top_p=1.0, top_k=0)]
    assert scores[:2] == [4.0, 1.0] and math.isnan(scores[2])
    assert counts["judgements"] == 6 and counts["items_too_long"] == 1 and counts["items_unscored"] == 1
    assert counts["parsed"] + counts["unparsed"] + counts["out_of_range"] == counts["judgements"]
    # Every prompt too long: nothing judged, still counted.
    scores, counts, _ = Judge(cfg).judge(engine, ["q"], ["y" * 400])
    assert math.isnan(scores[0]) and counts["items_too_long"] == 1 and counts["judgements"] == 0


def test_judge_demonstrations_teach_the_format_on_both_ends_of_the_scale():
    from actors.rewards.judge import judge_demonstrations

    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(10)]
    demos = judge_demonstrations(rows, 6, DEFAULT_TEMPLATE, seed=0)
    assert len(demos) == 6
    cfg = JudgeConfig()
    for i, d in enumerate(demos):
        text = d["prompt"][0]["content"]
        assert text.startswith(DEFAULT_TEMPLATE.split("{prompt}")[0]) and rows[i]["prompt"] in text
        shown = text.split("<response>")[1].split("</response>")[0]
        score, status = parse_score(d["response"], cfg.score_pattern, cfg.min_score, cfg.max_score)
        assert status == "parsed"
        # Right answer -> top score; another row's answer -> 1 point.
        assert (shown == rows[i]["answer"]) == (i % 2 == 0) and score == (5.0 if i % 2 == 0 else 1.0)


def test_judge_scorer_drops_unjudged_samples_and_reports_counts():
    from actors.rewards.judge import JudgeScorer
    from actors.rewards.scorer import RewardError

    cfg = JudgeConfig(samples=2, max_prompt_tokens=len(DEFAULT_TEMPLATE) + 200)
    engine = FakeEngine({"good": ["Score: 5", "Score: 4"], "junk": ["hmm", "no idea"]})
    scorer = JudgeScorer(cfg, None, engine=engine)
    exp = Experience(
        input_ids=torch.ones(2, 3, dtype=torch.long),
        attention_mask=torch.ones(2, 3, dtype=torch.bool),
        response_mask=torch.tensor([[False, True, True]] * 2),
        rollout_logprobs=torch.zeros(2, 3),
        group_ids=torch.arange(2),
        truncated=torch.zeros(2, dtype=torch.bool),
        policy_version=0,
        completions=["good", "junk"],
        meta=[{"prompt": "q1"}, {"prompt": "q2"}],
    ).validate()
    out = scorer.score(exp)
    assert out.completions == ["good"] and out.scores.tolist() == [4.5]
    assert out.skipped == {"unjudged": 1}
    assert scorer.last_metrics["judge/parsed"] == 2 and scorer.last_metrics["judge/unparsed"] == 2
    with pytest.raises(RewardError, match="no reward for sample 1"):
        JudgeScorer(cfg, None, on_error="raise", engine=engine).score(exp)


def verdict_word(reply: str):
    """A score parser: 'excellent' is 5, 'poor' is 1, a number word it does not know is none."""
    words = {"excellent": 5, "poor": 1, "weird": 99}
    if "boom" in reply:
        raise RuntimeError("parser failed")
    return next((v for w, v in words.items() if w in reply.lower()), None)


def test_a_score_parser_function_reads_replies_and_sampling_settings_reach_the_engine():
    cfg = JudgeConfig(
        samples=4,
        top_p=0.9,
        top_k=20,
        score_parser="tests.unit.test_judge:verdict_word",
        max_prompt_tokens=len(DEFAULT_TEMPLATE) + 200,
    )
    engine = FakeEngine({"A": ["Excellent work.", "poor", "Score: 5", "boom"], "B": ["weird", "poor.", "", ""]})
    scores, counts, _ = Judge(cfg).judge(engine, ["q1", "q2"], ["A", "B"])
    assert engine.calls[0]["top_p"] == 0.9 and engine.calls[0]["top_k"] == 20
    assert scores == [3.0, 1.0]  # the pattern's "Score: 5" is not the parser's, and is not read
    assert counts["parsed"] == 3 and counts["out_of_range"] == 1 and counts["unparsed"] == 4
    for bad, msg in (("nomodule", "module:function"), ("no_such_mod:f", "no_such_mod"), ("math:pi", "not callable")):
        with pytest.raises(ValueError, match=msg):
            JudgeConfig(score_parser=bad)
