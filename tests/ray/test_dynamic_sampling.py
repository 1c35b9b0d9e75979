"""DAPO's dynamic sampling on the real stack: a step keeps drawing prompts until its batch holds
``rollout.dynamic_sampling`` groups whose scores are not all equal, trains on exactly those, and
stops at ``rollout.dynamic_sampling_max_draws`` with the shortfall counted. Which prompts are
informative is a function of their text (``tests/helpers/rewards.py``), so the expected draws of
every step follow from the run's prompt sampler alone, before any sampling."""

from pathlib import Path

import pytest

from cluster.config.loading import load_config
from cluster.data.sources import load_task_prompts
from cluster.driver import train
from cluster.ops.ledger import read_ledger, summarize
from cluster.data.prompts import PromptSampler
from tests.helpers.rewards import informative_prompt
from tests.helpers.runs import rows

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
STEPS, PROMPTS, TARGET, MAX_DRAWS = 3, 4, 3, 1


def _expected(cfg) -> list[dict]:
    """Per step: the extra draws, the uids kept (the first TARGET informative ones) and the
    shortfall, replaying the run's sampler."""
    train_set, _, _ = load_task_prompts(cfg)
    sampler = PromptSampler(len(train_set.rows), PROMPTS, cfg.run.seed)
    out = []
    for _ in range(STEPS):
        draws, informative = -1, []
        while draws < 0 or (len(informative) < TARGET and draws < MAX_DRAWS):
            draws += 1
            ids, uids = sampler.next_with_uids()
            informative += [u for i, u in zip(ids, uids) if informative_prompt(train_set.rows[i]["prompt"])]
        out.append(
            {
                "draws": draws,
                "kept": informative[:TARGET],
                "shortfall": TARGET - len(informative[:TARGET]),
                "issued": (draws + 1) * PROMPTS,
            }
        )
    return out


def test_each_step_trains_on_the_informative_groups_it_drew(ray_cluster, tmp_path):
    cfg = load_config(
        ROOT / "configs" / "ppo_tiny.yaml",
        [
            f"run.steps={STEPS}",
            "ppo.advantage_estimator=grpo",
            "rollout.samples_per_prompt=4",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.dynamic_sampling={TARGET}",
            f"rollout.dynamic_sampling_max_draws={MAX_DRAWS}",
            "reward.function=tests.helpers.rewards:some_groups_informative",
            "run.eval_every=0",
            "run.plot=false",
            "run.save_final=false",
        ],
    )
    expected = _expected(cfg)
    # The data gives both cases: steps that fill up with extra draws, and one that runs out.
    assert any(e["draws"] > 0 and not e["shortfall"] for e in expected) and any(e["shortfall"] for e in expected)
    run_dir = tmp_path / "run"
    train(cfg, run_dir=run_dir)
    got = [r for r in rows(run_dir) if r["step"] > 0]
    assert [
        (r["dynamic_sampling/draws"], r["dynamic_sampling/groups"], r["dynamic_sampling/shortfall"]) for r in got
    ] == [(e["draws"], TARGET - e["shortfall"], e["shortfall"]) for e in expected]
    records = read_ledger(run_dir)
    for step, e in enumerate(expected, 1):
        trained = sorted(r["uid"] for r in records if r["event"] == "trained" and r["step"] == step)
        assert trained == sorted(e["kept"]), (step, trained, e)
        assert sum(1 for r in records if r["event"] == "issued" and r["step"] == step) == e["issued"]
        reasons = [next(iter(r["reasons"])) for r in records if r["event"] == "dropped" and r["step"] == step]
        assert len(reasons) == e["issued"] - len(e["kept"]) and set(reasons) <= {"uninformative", "surplus"}
    p = summarize(records)["prompts"]
    assert p["lost"] == 0 and p["issued"] == sum(e["issued"] for e in expected)
    # The learners saw only the kept groups: TARGET groups of 4 samples (fewer after a shortfall).
    assert [r["learner/sequences"] for r in got] == [4.0 * (TARGET - e["shortfall"]) for e in expected]
