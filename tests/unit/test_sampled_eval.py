"""run.eval_sampled: an evaluation also scores seeded samples of the held-out prompts.

The rollout group is a stand-in here (the real one is exercised by the Ray recipe tests): it
records what it was asked and scores each reply as a fixed function of (prompt, greedy, seed).
"""

import pytest

from cluster.config import Config
from cluster.data.prompts import eval_seed, held_out_eval, sampling_seed


class Rollout:
    samples_per_prompt = 2

    def __init__(self) -> None:
        self.calls: list[tuple[bool, int | None]] = []
        self.events: list[str] = []

    def submit(self, rows, group_ids, greedy=False, seed=None):
        self.calls.append((greedy, seed))
        self.events.append("submit")
        n = 1 if greedy else self.samples_per_prompt
        # Two work units, as a pool of generators returns them.
        half = len(rows) // 2
        units = [(greedy, seed, rows[:half]), (greedy, seed, rows[half:])]
        return {"units": [(u, n) for u in units]}

    def collect(self, pending, on_reissue=None):
        self.events.append("collect")
        return pending["units"], [{} for _ in pending["units"]]

    def score_checked(self, exp_refs):
        stats = []
        for (greedy, seed, rows), n in exp_refs:
            if greedy:
                stats.append({"scores": [1.0 if r["x"] % 2 else 0.0 for r in rows]})
            else:  # sample k of prompt x: solved when (x + k) % 3 == 0; a partial 0.5 otherwise
                stats.append({"scores": [1.0 if (r["x"] + k) % 3 == 0 else 0.5 for r in rows for k in range(n)]})
        return exp_refs, stats


def test_sampled_evaluation_scores_every_sample_with_the_fixed_seed():
    rollout, rows = Rollout(), [{"x": x} for x in range(6)]
    row = held_out_eval(rollout, rows, sampled_seed=77)
    assert rollout.calls == [(True, None), (False, 77)]
    assert rollout.events == ["submit", "submit", "collect", "collect"]  # both queued before waiting
    assert row["eval/accuracy"] == pytest.approx(3 / 6) and row["eval/n"] == 6
    # 12 samples, solved where (x + k) % 3 == 0: (0,0) (2,1) (3,0) (5,1)
    solved = [(x, k) for x in range(6) for k in range(2) if (x + k) % 3 == 0]
    assert len(solved) == 4
    assert row["eval/sampled_n"] == 12 and row["eval/sampled_accuracy"] == pytest.approx(4 / 12)
    assert row["eval/sampled_reward"] == pytest.approx((4 * 1.0 + 8 * 0.5) / 12)


def test_without_the_option_only_greedy_runs():
    rollout = Rollout()
    row = held_out_eval(rollout, [{"x": 1}, {"x": 2}])
    assert rollout.calls == [(True, None)] and not any(k.startswith("eval/sampled") for k in row)


def test_every_evaluation_of_a_run_samples_with_one_seed_no_training_step_uses():
    cfg = Config.model_validate({"run": {"seed": 5, "eval_sampled": True}})
    assert eval_seed(cfg) == sampling_seed(5, 0)
    assert eval_seed(cfg) not in {sampling_seed(5, s) for s in range(1, 1000)}
    assert eval_seed(Config.model_validate({"run": {"seed": 5}})) is None
