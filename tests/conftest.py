"""Shared, expensive fixtures: one tiny-model asset and one local Ray cluster per session.

The cluster is started with the ``ray`` CLI (not ``ray.init()``), with a dashboard on
127.0.0.1, so tests exercise the same paths users take: joining a running cluster and
submitting jobs to it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from actors.start_up import lighter_gc
from serving.common import free_port
from tests.helpers.timeouts import SCALE, scaled

lighter_gc()  # this process imports torch, vLLM and transformers too (actors/start_up.py)
ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAYRLHF_CACHE", str(ROOT / ".cache" / "rayrlhf"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Train's controller polls its workers every 2 s by default, so a finished learner group
# took up to 2 s to be noticed and torn down after every run (about 30 runs in the suite). The
# same poll finds a dead worker (tests/ray/test_failures.py) sooner; the learners' report pacing
# follows the value (cluster/roles/learner_group.py: report_gap_s).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# Ray starts its workers at nice 15 (RAY_worker_niceness), below anything else on the host: beside
# a busy process at nice 0 they got ~3% of a core each and a run's steps stretched tenfold
# (tests/stress.sh hog). Every cluster the suite starts inherits this environment.
os.environ.setdefault("RAY_worker_niceness", "0")

# Token authentication with a token of our own, set before anything imports ray (it reads the
# auth settings once): the default (~/.ray/auth_token, if some earlier cluster wrote one) would
# make the tests depend on the machine's history.
_SESSION_TMP = tempfile.mkdtemp(prefix="rrt-", dir="/tmp")
(Path(_SESSION_TMP) / "auth_token").write_text(secrets.token_hex(32))
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN_PATH"] = str(Path(_SESSION_TMP) / "auth_token")
# The roles' fault points (cluster/roles/fault_points.py), off until a test arms one: every
# cluster the suite starts inherits this (tests/helpers/kills.py aims its kills there).
os.environ["RAYRLHF_FAULT_POINTS"] = str(Path(_SESSION_TMP) / "fault-points")


def pytest_unconfigure(config):
    """The session folder goes with the session, whether or not a test started the cluster (made at
    import, not in a fixture: the auth settings must be in place before anything imports ray)."""
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


# Ray's log monitor globs the session's log folder every 0.1 s while it holds fewer than this many
# files (ray/_private/log_monitor.py), and every 0.5 s above it. A test session leaves hundreds of
# worker logs there, so the fast glob alone cost ~5% of a core by the end; 0 keeps the 0.5 s one.
QUIET_CLUSTER_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from cluster.assets import build_tiny

    return str(build_tiny(Path(os.environ["RAYRLHF_CACHE"])))


@pytest.fixture(scope="session")
def tiny_moe_path() -> str:
    """The tiny mixture of experts (Qwen3-MoE, 2 layers x 8 experts, top-2), random weights."""
    from cluster.assets import build_tiny_moe

    return str(build_tiny_moe(Path(os.environ["RAYRLHF_CACHE"])))


@pytest.fixture(scope="session")
def sdk_tool_caller(tiny_model_path, tmp_path_factory) -> str:
    """The tiny model taught the calculator conversation as the OpenAI Agents SDK and LangChain
    send it (``tests/helpers/sdk_agents.py``): through either client it calls the tool, reads its
    answer and answers (greedy). Trained once per session (~15 s)."""
    from tests.helpers.sdk_agents import demonstrations
    from tests.helpers.tool_agent import train_tool_caller

    folder, metrics = train_tool_caller(
        tiny_model_path, tmp_path_factory.mktemp("sdk_tool_caller") / "model", steps=80, conversations=demonstrations()
    )
    assert metrics["loss/total"] < 0.05, metrics
    return str(folder)


@pytest.fixture(scope="module")
def tool_caller_engine(sdk_tool_caller):
    """An in-process vLLM engine of the SDK tool caller (fp32, 1024 positions), its agent
    endpoint and a pool for agent programs, per test module that asks for them."""
    import concurrent.futures

    from actors.agents.agent_server import AgentEndpoint
    from actors.rollout.generator import Generator
    from tests.helpers.engines import engine_config

    gen = Generator(engine_config(sdk_tool_caller, 1024))
    endpoint = AgentEndpoint()
    pool = concurrent.futures.ThreadPoolExecutor(8)
    yield gen, endpoint, pool
    pool.shutdown()
    endpoint.close()
    gen.close()


@pytest.fixture(scope="module")
def tool_caller_hf(sdk_tool_caller):
    """The same model in transformers (fp32): the log-probs a forward pass gives."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sdk_tool_caller, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def generator(tiny_model_path, request):
    """One in-process vLLM engine of the tiny model per test module that asks for it (context
    length: the module's ``ENGINE_MAX_MODEL_LEN``, default 256), closed at the module's end:
    vLLM keeps one parallel state per process and an engine collected later would tear down the
    next module's (``Generator.close``)."""
    from actors.rollout.generator import Generator
    from tests.helpers.engines import engine_config

    gen = Generator(engine_config(tiny_model_path, getattr(request.module, "ENGINE_MAX_MODEL_LEN", 256)))
    yield gen
    gen.close()


@pytest.fixture(scope="session")
def ray_cluster(tiny_model_path):
    """A local head node with a dashboard; yields its addresses and connects this process. No test
    reads the dashboard, but Ray Train's placement-group cleaner watches its controller through
    the state API, which the dashboard serves: without it every run's cleaner polls in vain and
    outlives the run (a detached actor)."""
    import ray

    from cluster.connection import job_runtime_env

    port, dash = free_port(), free_port()
    temp = _SESSION_TMP
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    # Workers import test helpers (misbehaving reward functions) by module name.
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(QUIET_CLUSTER_ENV)
    ray_bin = str(Path(bindir) / "ray")
    cmd = [
        ray_bin,
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=8",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        f"--temp-dir={temp}",
        "--disable-usage-stats",
    ]
    address = f"127.0.0.1:{port}"
    info = {"address": address, "dashboard": f"http://127.0.0.1:{dash}", "env": env}
    try:  # `ray start` inside: a start that times out half-way still leaves nothing running
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=scaled(120))
        # The job's setup hook, as `rayrlhf train` sets it (cluster/run_context.py: job_runtime_env).
        ray.init(address=address, log_to_driver=True, runtime_env=job_runtime_env({}))
        yield info
    finally:
        ray.shutdown()
        _stop_cluster(temp, port)
        shutil.rmtree(temp, ignore_errors=True)


def _stop_cluster(temp: str, port: int) -> None:
    """Stops this session's cluster only: ``ray stop`` would also kill every other Ray cluster
    on the machine (a second test session, a user's job). Its processes name the session's temp
    dir or its GCS port on their command line; workers and dashboard modules are their children."""
    import psutil

    def ours(proc: psutil.Process) -> bool:
        try:
            line = " ".join(proc.cmdline())
        except (psutil.Error, OSError):
            return False
        return temp in line or f":{port} " in line + " " or f":{port}," in line

    roots = [p for p in psutil.process_iter() if p.pid != os.getpid() and ours(p)]
    procs = {p.pid: p for p in roots}
    for p in roots:
        try:
            procs.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            pass
    procs.pop(os.getpid(), None)
    for p in procs.values():
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=5)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


def wait_for(predicate, timeout: float, interval: float = 0.5, describe=None):
    """Polls ``predicate`` until it returns something truthy, which it returns. ``timeout`` is a
    guard against a hang, scaled by ``RAYRLHF_TEST_TIMEOUT_SCALE`` (tests/helpers/timeouts.py);
    when it fires, ``describe()`` (if given) says what the system under test was doing."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    state = f"; {describe()}" if describe is not None else ""
    raise TimeoutError(f"condition not met in {limit:.0f} s (RAYRLHF_TEST_TIMEOUT_SCALE={SCALE:g}){state}")


@pytest.fixture(scope="module")
def serve_url(ray_cluster):
    """Ray Serve's HTTP proxy on 127.0.0.1, for one test module: Serve's controller and proxy poll
    (about a tenth of a core together), so they are shut down when the module that needs them ends
    rather than left running through the rest of the suite."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
