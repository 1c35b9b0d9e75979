"""The run's last line says what it learned, with its uncertainty: the change of the held-out
accuracy from the first evaluation to the last with the standard error of that change, the
sampled accuracy beside it, and the train reward of the first and last third of the steps."""

import math

import pytest

from cluster.ops.learned import change_with_error, learned_line


def test_the_change_and_its_standard_error_are_the_binomial_ones():
    delta, se = change_with_error(0.25, 256, 0.3125, 256)
    assert delta == pytest.approx(0.0625)
    # sqrt(.25*.75/256 + .3125*.6875/256), by hand
    assert se == pytest.approx(math.sqrt(0.1875 / 256 + 0.21484375 / 256))
    assert change_with_error(0.0, 10, 0.0, 10) == (0.0, 0.0)


def test_the_line_names_both_evaluations_the_band_and_the_train_reward_by_thirds():
    rows = [
        {"step": 0, "eval/accuracy": 0.25, "eval/n": 256.0, "eval/sampled_accuracy": 0.125, "eval/sampled_n": 256.0}
    ]
    rows += [{"step": s, "reward/mean": r} for s, r in zip(range(1, 7), [0.1, 0.2, 0.3, 0.3, 0.5, 0.6])]
    rows += [
        {"step": 6, "eval/accuracy": 0.3125, "eval/n": 256.0, "eval/sampled_accuracy": 0.25, "eval/sampled_n": 256.0}
    ]
    line = learned_line(rows)
    _, se = change_with_error(0.25, 256, 0.3125, 256)
    assert line.startswith("[rayrlhf] learned: held-out greedy accuracy 0.250 (step 0) -> 0.312 (step 6): +0.062 ± ")
    assert f"± {se:.3f} (1 s.e., 256 prompts, {0.0625 / se:.1f} s.e. apart)" in line
    assert "held-out sampled accuracy 0.125 (step 0) -> 0.250 (step 6): +0.125" in line
    assert line.endswith("train reward 0.150 (first third of steps) -> 0.550 (last third)")


def test_nothing_to_compare_gives_no_line_and_an_unknown_count_no_band():
    assert learned_line([{"step": 1, "loss/total": 1.0}]) is None
    line = learned_line([{"step": 0, "eval/accuracy": 0.5}, {"step": 3, "eval/accuracy": 0.75}], "reward accuracy")
    assert line == "[rayrlhf] learned: held-out reward accuracy 0.500 (step 0) -> 0.750 (step 3): +0.250"
