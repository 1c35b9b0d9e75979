"""Smoke test of the real entry point: `ray job submit ... -- rayrlhf train ...` against a Ray
head started the way the README says (dashboard on 127.0.0.1, token authentication, the
machine's own CPUs); the job joins that cluster. Plus the CLI's one-line user errors."""

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.timeouts import scaled

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.smoke


def _scrape(port: int) -> dict[str, float]:
    """The project's Ray metrics on a node's Prometheus endpoint: ``name{labels}`` -> value."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("ray_rayrlhf_"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


class _Scraper(threading.Thread):
    """Reads the Prometheus endpoint every half second while the job runs and keeps every scrape
    that has the run's reward: polling between `ray job status` calls (seconds each on a loaded
    machine) could miss a short run's metrics altogether."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.scrapes, self.done = port, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            scraped = _scrape(self.port)
            if _metric(scraped, "ray_rayrlhf_reward_mean") is not None:
                self.scrapes.append(scraped)
            self.done.wait(0.5)


def _wait_for_dashboard(address: str, timeout_s: float = 180.0) -> None:
    """Until the dashboard's HTTP server answers at all: on a loaded machine `ray start` may return
    (it waits at most 60 s for the dashboard) before the server listens."""
    deadline = time.time() + scaled(timeout_s)
    while True:
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=10)
            return
        except urllib.error.HTTPError:
            return  # it answered (401 without the token)
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(1.0)


def _metric(scraped: dict[str, float], name: str, **labels: str) -> float | None:
    for key, value in scraped.items():
        if key.startswith(name + "{") and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    return None


def test_ray_job_submit_on_a_cluster_started_as_the_readme_says(tiny_model_path, tmp_path):
    """README's "On a running cluster": `ray start --head --dashboard-host=127.0.0.1
    --metrics-export-port=...` (no --num-cpus: the machine's CPUs; metrics exported every second),
    token authentication on, then the real `ray job submit`. During the run Prometheus' endpoint
    serves the project's metrics; the job succeeds and leaves its outputs (TensorBoard events
    included)."""
    from serving.common import free_port
    from tests.conftest import _stop_cluster

    temp = tempfile.mkdtemp(prefix="rrj-", dir="/tmp")
    token = Path(temp) / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
    }
    env.pop("RAY_ADDRESS", None)
    port, dash, metrics_port, agent, client = (free_port() for _ in range(5))
    ray_bin = str(Path(sys.executable).parent / "ray")
    address = f"http://127.0.0.1:{dash}"
    scraper = _Scraper(metrics_port)
    try:  # `ray start` inside: a start that fails half-way is stopped all the same
        # Ports: the README's command plus free ports where Ray's defaults would collide with the
        # session's shared test cluster (the job agent's HTTP port 52365, the client server's 10001).
        # Metrics are exported every second (README: "--system-config ... 1000"), not every 10 s: a
        # 10-step tiny run can finish between two exports of Ray's default interval.
        subprocess.run(
            [
                ray_bin,
                "start",
                "--head",
                f"--port={port}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dash}",
                f"--metrics-export-port={metrics_port}",
                f"--temp-dir={temp}",
                f"--dashboard-agent-listen-port={agent}",
                f"--ray-client-server-port={client}",
                '--system-config={"metrics_report_interval_ms":1000}',
                "--disable-usage-stats",
            ],
            check=True,
            env=env,
            capture_output=True,
            timeout=scaled(300),
        )
        _wait_for_dashboard(address)
        # The dashboard answers only requests carrying the cluster's token.
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(f"{address}/api/version", timeout=30)
        out_dir = tmp_path / "runs"
        # Right after `ray start` the dashboard may not have a job agent yet ("No available agent to
        # submit job, please try again later"): submit again until one takes it, as a user would.
        submit_deadline = time.time() + scaled(240)
        while True:
            submit = subprocess.run(
                [
                    ray_bin,
                    "job",
                    "submit",
                    "--address",
                    address,
                    "--working-dir",
                    str(ROOT),
                    "--no-wait",
                    "--",
                    "rayrlhf",
                    "train",
                    "configs/ppo_tiny.yaml",
                    "--set",
                    "run.steps=10",
                    "--set",
                    f"run.output_dir={out_dir}",
                    "--set",
                    "run.name=smoke",
                    "--set",
                    "run.eval_every=10",
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=scaled(300),
                cwd=ROOT,
            )
            if "No available agent" not in submit.stdout + submit.stderr or time.time() > submit_deadline:
                break
            time.sleep(2.0)
        assert submit.returncode == 0, submit.stdout + submit.stderr
        job_id = re.search(r"Job '([^']+)' submitted successfully", submit.stdout + submit.stderr).group(1)
        scraper.start()
        status = ""
        deadline = time.time() + scaled(600)
        while time.time() < deadline:
            try:
                status = subprocess.run(
                    [ray_bin, "job", "status", "--address", address, job_id],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=scaled(120),
                ).stdout.lower()
            except subprocess.TimeoutExpired:  # a slowed host (once over 60 s): ask again until the deadline
                status = ""
            if any(s in status for s in ("succeeded", "failed", "stopped")):
                break
            # Each `ray job status` is a new process importing Ray (about 2 s of CPU): polled every
            # second they took a third of this 2-core machine from the job they were watching.
            time.sleep(5.0)
        logs = subprocess.run(
            [ray_bin, "job", "logs", "--address", address, job_id], env=env, capture_output=True, text=True, timeout=60
        ).stdout
        assert "succeeded" in status, status + logs[-4000:]
        # `rayrlhf train` typed on the same machine, no RAY_ADDRESS: it joins the head `ray start`
        # left running (found through Ray's address file; here in the head's temp dir) and says so.
        own = subprocess.run(
            [
                str(Path(sys.executable).parent / "rayrlhf"),
                "train",
                "configs/ppo_tiny.yaml",
                "--set",
                "run.steps=1",
                "--set",
                "run.eval_every=0",
                "--set",
                f"cluster.temp_dir={temp}",
                "--set",
                f"run.output_dir={tmp_path / 'local'}",
                "--set",
                "run.plot=false",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=scaled(600),
            cwd=ROOT,
        )
    finally:
        scraper.done.set()
        _stop_cluster(temp, port)
        shutil.rmtree(temp, ignore_errors=True)
    assert own.returncode == 0, own.stdout[-3000:] + own.stderr[-3000:]
    assert re.search(
        r"Ray cluster: 1 node\(s\), \d+ CPUs.*\(joined: joined the cluster `ray start` left at [\d.]+:" + str(port),
        own.stdout,
    ), own.stdout[-3000:]
    assert "step 1/1" in own.stdout
    # The job joined the cluster it was submitted to, which has the machine's CPUs, and fit on it.
    assert re.search(r"\[rayrlhf\] Ray cluster: 1 node\(s\), \d+ CPUs.*\(joined\)", logs), logs[-3000:]
    assert "step 10/10" in logs
    # Prometheus saw the project's metrics mid-run, with sane values.
    scraper.join(timeout=30)
    assert scraper.scrapes, "no ray_rayrlhf_* metric on the Prometheus endpoint during the run"
    seen = scraper.scrapes[-1]
    step = _metric(seen, "ray_rayrlhf_step")
    reward = _metric(seen, "ray_rayrlhf_reward_mean")
    assert step is not None and 1 <= step <= 10 and 0.0 <= reward <= 1.0, seen
    assert (_metric(seen, "ray_rayrlhf_rollout_tokens_per_s") or 0) > 0, seen
    assert (_metric(seen, "ray_rayrlhf_phase_seconds", phase="learn") or 0) > 0, seen
    # 32 prompts issued per finished step. The gauges are set one after another, so an export can
    # fall between two of them: some scrape (not necessarily every one) shows them consistent.
    pairs = [
        (_metric(s, "ray_rayrlhf_step"), _metric(s, "ray_rayrlhf_prompts", event="issued")) for s in scraper.scrapes
    ]
    assert any(st is not None and st >= 1 and issued == 32 * st for st, issued in pairs), pairs
    runs = list(out_dir.glob("smoke-*"))
    assert len(runs) == 1
    rows = [json.loads(l) for l in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(11))  # step 0: the starting policy's evaluation
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    assert "before training: held-out greedy accuracy" in logs and "[rayrlhf] learned: held-out greedy accuracy" in logs
    assert (runs[0] / "curves.png").is_file()
    assert (runs[0] / "checkpoints" / "step_00010" / "model.safetensors").is_file()
    events = list((runs[0] / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and b"reward/mean" in events[0].read_bytes()
    assert (runs[0] / "train.log").is_file() and (runs[0] / "ledger.jsonl").is_file()


def test_cli_rejects_a_wrong_config_key_before_starting_anything(tmp_path):
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "rayrlhf"),
            "train",
            "configs/ppo_tiny.yaml",
            "--set",
            "ppo.learning_rate=1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "ppo.learning_rate" in proc.stderr and "valid keys" in proc.stderr


@pytest.mark.parametrize(
    "override, words",
    [
        ("data.task=jsonl:/nonexistent/prompts.jsonl", "data file or folder not found"),
        ("data.task=no_such_task", "no_such_task"),
        ("reward.function=no_such_module:score", "cannot import module"),
        ("model.path=/nonexistent/model", "neither a built-in asset"),
    ],
)
def test_cli_reports_user_errors_in_one_line(tmp_path, override, words):
    """What the user named must exist: one clear line and exit code 2, no traceback, nothing started."""
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "rayrlhf"),
            "train",
            "configs/ppo_tiny.yaml",
            "--set",
            override,
            "--set",
            f"run.output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rayrlhf:")]
    assert len(lines) == 1 and words in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # no run directory was created


def test_cli_resume_refuses_a_changed_model(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((ROOT / "configs" / "ppo_tiny.yaml").read_text())
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "rayrlhf"),
            "train",
            "--resume",
            str(run),
            "--set",
            "model.path=smollm2-135m",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "cannot resume with a different model.path" in proc.stderr, proc.stderr
