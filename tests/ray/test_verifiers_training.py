"""verifiers environments train on the real stack (``env.name: verifiers:<module>``): the
package's multi-turn environment and its tool environment (``tests/helpers/vf``) run their own
rollouts in the generators against the agent endpoint; the learners train on the tokens the
engine sampled (their log-probs equal the engine's), and the rubric's functions reach the
metrics, consistent with the episode rewards (reward = the functions' weighted sum)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config.loading import load_config
from cluster.driver import train
from tests.helpers.runs import rows

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
COMMON = [
    "run.steps=2",
    "ppo.advantage_estimator=grpo",
    "rollout.samples_per_prompt=2",
    "rollout.prompts_per_step=2",
    "data.eval_size=2",
    "run.eval_every=0",
    "run.plot=false",
    "run.save_final=false",
]


def test_a_multi_turn_and_a_tool_environment_train_and_their_rubrics_reach_the_metrics(
    ray_cluster, tmp_path, sdk_tool_caller
):
    train(
        load_config(ROOT / "configs" / "ppo_tiny.yaml", [*COMMON, "env.name=verifiers:tests.helpers.vf.multi_turn"]),
        run_dir=tmp_path / "turns",
    )
    train(
        load_config(
            ROOT / "configs" / "ppo_tiny.yaml",
            [
                *COMMON,
                "env.name=verifiers:tests.helpers.vf.tools",
                f"model.path={sdk_tool_caller}",
                "model.max_new_tokens=96",
                "model.max_prompt_tokens=512",
                "env.max_tokens=1000",
            ],
        ),
        run_dir=tmp_path / "tools",
    )

    turns, tools = (
        [r for r in rows(tmp_path / "turns") if r["step"] > 0],
        [r for r in rows(tmp_path / "tools") if r["step"] > 0],
    )
    assert [r["step"] for r in turns] == [r["step"] for r in tools] == [1, 2]
    for r in turns:  # three calls per episode, one trajectory each, every episode kept
        assert r["episode/status_done"] == 4 and r["episode/segments"] == 4 and r["episode/turns_mean"] == 3.0
        assert r["episode/metric/turns/mean"] == 3.0
        assert r["reward/mean"] == pytest.approx(
            r["episode/reward/digits/mean"] + 0.5 * r["episode/reward/every_turn/mean"]
        )
    for r in tools:
        assert r["episode/status_done"] == 4
        assert r["reward/mean"] == pytest.approx(
            r["episode/reward/correct/mean"] + 0.2 * r["episode/reward/used_tool/mean"]
        )
    # The trained tokens are the sampled ones: the learners' log-probs of them are the engine's.
    assert max(r["logprob_gap/max_abs"] for r in turns + tools) < 1e-3
