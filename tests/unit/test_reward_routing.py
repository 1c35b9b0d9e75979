"""Rewards by the row's source and as weighted sums: each row reaches its own functions, an
unmapped source is counted (never scored 0), the sum equals a naive loop, a failing component
fails only its samples, and each component's mean reaches the step row."""

import math

import pytest

from actors.rewards.routing import RoutedScorer
from cluster.config import ConfigError
from cluster.config.loading import load_config
from cluster.ops.metrics import judge_metrics

SEEN: dict[str, list[str]] = {}


def length(prompts, completions, **meta):
    SEEN.setdefault("length", []).extend(completions)
    return [float(len(c)) for c in completions]


def is_yes(prompts, completions, **meta):
    SEEN.setdefault("is_yes", []).extend(completions)
    return [float(c == "yes") for c in completions]


def broken_on_x(prompts, completions, **meta):
    return [float("nan") if c == "x" else 1.0 for c in completions]


def _meta(sources):
    return [{"data_source": s, "answer": "1"} for s in sources]


def test_each_row_reaches_its_sources_functions_and_an_unmapped_source_is_counted():
    SEEN.clear()
    scorer = RoutedScorer({"a": [(f"{__name__}:length", 1.0, {})], "b": [(f"{__name__}:is_yes", 1.0, {})]})
    completions = ["yes", "no", "yes!", "yes", "zz"]
    values, counts = scorer.score_texts([""] * 5, completions, _meta(["a", "b", "a", "b", "c"]))
    assert values == [3.0, 0.0, 4.0, 1.0, None]
    assert counts == {"reward_unmapped_source": 1}
    assert SEEN == {"length": ["yes", "yes!"], "is_yes": ["no", "yes"]}


def test_a_weighted_sum_equals_a_naive_loop():
    comps = [(f"{__name__}:length", 0.25, {}), (f"{__name__}:is_yes", -2.0, {}), ("digit_density", 3.0, {})]
    scorer = RoutedScorer({None: comps})
    completions = ["yes", "no 12", "a1b2", "yes", ""]
    values, counts = scorer.score_texts([""] * 5, completions, _meta([None] * 5))
    from actors.rewards.functions import digit_density

    naive = []
    for c in completions:
        naive.append(0.25 * len(c) - 2.0 * (c == "yes") + 3.0 * digit_density([""], [c])[0])
    assert counts == {} and all(math.isclose(v, n) for v, n in zip(values, naive))


def test_a_failing_component_fails_only_its_samples_and_means_reach_the_row():
    scorer = RoutedScorer(
        {
            "a": [(f"{__name__}:broken_on_x", 1.0, {}), (f"{__name__}:length", 1.0, {})],
            "b": [(f"{__name__}:length", 2.0, {})],
        }
    )
    values, counts = scorer.score_texts([""] * 4, ["x", "ok", "abc", "x"], _meta(["a", "a", "b", "b"]))
    assert values == [None, 3.0, 6.0, 2.0] and counts == {"reward_nonfinite": 1}
    # Two shards' metrics sum, and each component's and source's mean is over the samples it scored.
    first = dict(scorer.last_metrics)
    scorer.score_texts([""], ["hello"], _meta(["b"]))
    row = judge_metrics([{"metrics": first}, {"metrics": scorer.last_metrics}])
    assert row["reward/component/length/n"] == 5  # a's "x" failed in broken_on_x, length still scored it
    assert row["reward/component/length/mean"] == pytest.approx((1 + 2 + 3 + 1 + 5) / 5)
    assert "reward/component/length_2/n" not in row  # one function, logged unweighted: one metric
    assert row["reward/source/b/mean"] == pytest.approx((6 + 2 + 10) / 3)
    assert row["reward/source/a/n"] == 1


def test_the_config_builds_the_routed_scorer_and_rejects_what_cannot_combine():
    from actors.rewards.scorer_factory import build_scorer
    from cluster.config.role_settings import scorer_spec

    cfg = load_config(
        overrides=['reward.by_source={"gsm8k": exact_match, "toy": [{function: digit_density, weight: 2}]}']
    )
    scorer = build_scorer(scorer_spec(cfg))
    assert isinstance(scorer, RoutedScorer)
    values, _ = scorer.score_texts(
        ["", ""], ["7", "12"], [{"data_source": "gsm8k", "answer": "7"}, {"data_source": "toy"}]
    )
    assert values == [1.0, 2.0]
    comps = load_config(overrides=["reward.components=[exact_match, {function: digit_density, weight: 0.5}]"])
    assert scorer_spec(comps).routes == {None: [("exact_match", 1.0, {}), ("digit_density", 0.5, {})]}
    with pytest.raises(ConfigError, match="replace reward.function"):
        load_config(
            overrides=[
                "reward.components=[exact_match]",
                "reward.function=remote",
                "reward.remote.url=http://127.0.0.1:1",
            ]
        )
    with pytest.raises(ConfigError, match="set one"):
        load_config(overrides=["reward.components=[exact_match]", "reward.by_source={a: exact_match}"])
