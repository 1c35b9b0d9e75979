import math

import pytest
import torch

from actors.rewards.functions import extract_final_answer, reasoning_gym
from actors.rewards.scorer import RewardError, Scorer, resolve_reward_fn
from tests.unit.test_experience import make


@pytest.mark.parametrize(
    "text, want",
    [
        ("5 + 8 = 13", "13"),
        ("The answer is 42.", "42"),
        ("\\boxed{7} then 9", "7"),
        ("x = -3", "-3"),
        ("1,234", "1234"),
        ("no number", "no number"),
        ("", None),
    ],
)
def test_extract_final_answer(text, want):
    assert extract_final_answer(text) == want


def test_reasoning_gym_checker_on_real_entries():
    from actors.data.tasks import reasoning_gym_rows

    rows = reasoning_gym_rows(
        "basic_arithmetic", 4, 1, {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, "Answer."
    ).rows
    meta = {k: [r["meta"][k] for r in rows] for k in rows[0]["meta"]}
    good = [f"{r['meta']['entry']['metadata']['expression']} = {r['answer']}" for r in rows]
    bad = [f"= {int(r['answer']) + 1}" for r in rows]
    assert reasoning_gym([r["prompt"] for r in rows], good, **meta) == [1.0] * 4
    assert all(x < 1.0 for x in reasoning_gym([r["prompt"] for r in rows], bad, **meta))


def test_resolve_reward_fn_errors():
    assert callable(resolve_reward_fn("actors.rewards:digit_density"))
    with pytest.raises(ValueError, match="neither a built-in"):
        resolve_reward_fn("nope")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no callable"):
        resolve_reward_fn("actors.rewards:missing")


def _exp_with(texts):
    exp = make(b=len(texts), nresp=[2] * len(texts))
    return exp.replace(completions=list(texts), meta=[{"question": ""} for _ in texts])


def test_bad_rewards_are_skipped_and_counted():
    texts = [chr(65 + i) * 3 for i in range(10)]  # ord sums cover every residue mod 5
    s = Scorer("tests.helpers.rewards:flaky")
    out = s.score(_exp_with(texts))
    residues = [sum(map(ord, t)) % 5 for t in texts]
    assert out.batch_size == sum(r >= 3 for r in residues)
    assert out.skipped["reward_error"] == residues.count(0)
    assert out.skipped["reward_nonfinite"] == residues.count(1) + residues.count(2)
    assert torch.isfinite(out.scores).all()
    assert out.completions == [t for t, r in zip(texts, residues) if r >= 3]


def test_bad_rewards_raise_when_configured():
    with pytest.raises(RewardError, match="raised"):
        Scorer("tests.helpers.rewards:flaky", on_error="raise").score(_exp_with(["AAA", "BBB", "CCC"]))
    with pytest.raises(RewardError, match="returned 1 values for 3"):
        Scorer("tests.helpers.rewards:wrong_length", on_error="raise").score(_exp_with(["a", "b", "c"]))


def test_wrong_length_is_isolated_per_sample_when_skipping():
    out = Scorer("tests.helpers.rewards:wrong_length").score(_exp_with(["a", "b"]))
    # Called one sample at a time the function returns the right length: nothing lost.
    assert out.batch_size == 2 and out.scores.tolist() == [0.0, 0.0]
    assert not math.isnan(float(out.scores.sum()))


def test_scorer_spec_from_the_run_config(monkeypatch):
    from actors.rewards.remote import RemoteSettings
    from cluster.config.role_settings import scorer_spec, self_judging
    from cluster.config import ConfigError
    from cluster.config.loading import load_config

    cfg = load_config(overrides=["reward.function=llm_judge", "reward.model=/models/judge", "judge.samples=2"])
    spec = scorer_spec(cfg)
    assert not self_judging(cfg)  # a judge model of its own: a scorer actor, not the generators
    assert spec.judge.samples == 2 and spec.judge_engine.model_path == "/models/judge"
    assert spec.judge_engine.max_model_len == cfg.judge.max_prompt_tokens + cfg.judge.max_new_tokens
    assert self_judging(load_config(overrides=["reward.function=llm_judge"]))
    monkeypatch.setenv("MY_SCORER_KEY", "k1")
    spec = scorer_spec(
        load_config(
            overrides=[
                "reward.function=remote",
                "reward.remote.url=http://127.0.0.1:9/v1/score",
                "reward.remote.api_key_env=MY_SCORER_KEY",
                "reward.remote.on_failure=stop",
            ]
        )
    )
    assert isinstance(spec.remote, RemoteSettings) and spec.remote.api_key == "k1" and spec.remote.on_failure == "stop"
    with pytest.raises(ConfigError, match="reward.model"):
        load_config(overrides=["reward.function=reward_model"])
    with pytest.raises(ConfigError, match="reward.remote.url"):
        load_config(overrides=["reward.function=remote"])
    with pytest.raises(ConfigError):
        load_config(overrides=["reward.remote.urll=http://x"])
