"""GRPO on the tiny task with its rewards from the scorer server (a Ray Serve app, over HTTP with
an API key). Mid-run the server is deleted and brought back: the run waits, the failed attempts
and the outage show in the metrics, no sample gets a reward the server did not give, and the
policy still learns. With on_failure=stop the run ends with an error naming the endpoint."""

import json
import threading
import time
from pathlib import Path

import pytest

from cluster.config.loading import load_config
from cluster.driver import train

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
KEY = "scorer-key-456"
APP = {"scorer": {"function": "actors.rewards:digit_density"}, "api_key_env": "RAYRLHF_TEST_SCORER_KEY"}


def _rows(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else []


@pytest.fixture
def scorer_url(serve_url, monkeypatch):
    from ray import serve

    from serving.scorer import build_scorer_app

    monkeypatch.setenv("RAYRLHF_TEST_SCORER_KEY", KEY)
    serve.run(build_scorer_app(APP), name="scorer", route_prefix="/scorer", blocking=False)
    yield f"{serve_url}/scorer/v1/score"
    serve.delete("scorer")


def _config(url: str, *extra: str):
    return load_config(
        ROOT / "configs" / "ppo_tiny.yaml",
        [
            "ppo.advantage_estimator=grpo",
            "rollout.samples_per_prompt=4",
            "rollout.prompts_per_step=8",
            "run.eval_every=0",
            "run.plot=false",
            "reward.function=remote",
            f"reward.remote.url={url}",
            "reward.remote.api_key_env=RAYRLHF_TEST_SCORER_KEY",
            "reward.remote.max_retries=2",
            "reward.remote.backoff_s=0.2",
            "reward.remote.max_backoff_s=1",
            *extra,
        ],
    )


def test_grpo_learns_through_a_scorer_outage(scorer_url, tmp_path):
    from ray import serve

    from serving.scorer import build_scorer_app

    run_dir = tmp_path / "run"
    outage: dict = {}

    def stop_and_restart() -> None:  # once step 3 is logged: delete the app, wait, deploy it again
        while len(_rows(run_dir)) < 3:
            time.sleep(0.2)
        serve.delete("scorer")
        outage["down_at_step"] = len(_rows(run_dir))
        time.sleep(6)
        serve.run(build_scorer_app(APP), name="scorer", route_prefix="/scorer", blocking=False)
        outage["up"] = True

    chaos = threading.Thread(target=stop_and_restart)
    chaos.start()
    train(
        _config(scorer_url, "run.steps=16", "reward.remote.on_failure=wait", "reward.remote.max_wait_s=180"),
        run_dir=run_dir,
    )
    chaos.join()
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 17)) and outage.get("up")
    # Every sample of every step was scored by the server: nothing dropped, nothing made up.
    assert all(r["reward/n"] == 32 for r in rows)
    assert not any(n for r in rows for k, n in r["skipped"].items() if k.startswith(("remote", "reward")))
    failed = [r for r in rows if r["remote/failed_attempts"] > 0]
    assert failed and all(r["step"] > 3 for r in failed)
    assert sum(r["remote/outages"] for r in rows) >= 1 and sum(r["remote/wait_s"] for r in rows) > 0
    start = sum(r["reward/mean"] for r in rows[:3]) / 3
    end = sum(r["reward/mean"] for r in rows[-3:]) / 3
    assert end > start + 0.1, (start, end)


def test_on_failure_stop_ends_the_run_with_a_clear_error(serve_url, tmp_path):
    from actors.rewards.remote import RemoteScorerError

    url = f"{serve_url}/nothing-here/v1/score"  # no app there: the proxy answers 404
    with pytest.raises(Exception) as info:
        train(_config(url, "run.steps=2", "reward.remote.on_failure=stop"), run_dir=tmp_path / "run")
    assert "nothing-here" in str(info.value) and ("404" in str(info.value) or isinstance(info.value, RemoteScorerError))


def test_scorer_server_answers_scores_and_refuses_bad_requests(scorer_url):
    import requests

    from actors.rewards.functions import digit_density

    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompts": ["p", "q"], "completions": ["12 apples", "none"]}
    r = requests.post(scorer_url, json=body, headers=auth, timeout=30)
    assert r.status_code == 200 and r.json()["scores"] == pytest.approx(digit_density(["p", "q"], body["completions"]))
    assert requests.post(scorer_url, json=body, timeout=30).status_code == 401
    assert requests.post(scorer_url, json=body, headers={"Authorization": "Bearer nope"}, timeout=30).status_code == 401
    bad = requests.post(scorer_url, json={"prompts": ["p"], "completions": []}, headers=auth, timeout=30)
    assert bad.status_code == 400 and "same length" in bad.json()["error"]["message"]
    bad = requests.post(scorer_url, data="{nope", headers={**auth, "Content-Type": "application/json"}, timeout=30)
    assert bad.status_code == 400
