"""The Serve config file in configs/serve/ is valid for `serve run` / `serve deploy` (Ray's own
schema) and every application's args are ones its builder accepts (no Ray started)."""

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_serve_config_file_is_valid():
    from ray.serve.schema import ServeDeploySchema

    from serving.policy import POLICY_ARGS
    from serving.scorer import scorer_spec_from_args

    raw = yaml.safe_load((ROOT / "configs" / "serve" / "apps.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw)
    assert schema.http_options.host == "127.0.0.1"  # loopback unless the user changes it
    apps = {a.name: a for a in schema.applications}
    assert apps["policy"].import_path == "serving.policy:build_policy_app"
    assert set(apps["policy"].args) <= set(POLICY_ARGS)
    assert apps["scorer"].import_path == "serving.scorer:build_scorer_app"
    assert scorer_spec_from_args(dict(apps["scorer"].args["scorer"])).function == "reasoning_gym"


def test_builders_refuse_unknown_settings():
    from serving.policy import build_policy_app
    from serving.scorer import scorer_spec_from_args

    with pytest.raises(ValueError, match="unknown policy server settings"):
        build_policy_app({"model_path": "x", "max_tokenz": 5})
    with pytest.raises(ValueError, match="unknown scorer settings"):
        scorer_spec_from_args({"function": "reasoning_gym", "modell": "x"})
    with pytest.raises(ValueError, match="not a model folder"):
        build_policy_app({"model_path": "/nonexistent"})


def test_a_server_started_on_its_own_cluster_runs_rays_workers_at_the_daemons_priority_keeps_no_idle_workers_and_a_slower_control_loop(
    monkeypatch,
):
    """`rayrlhf serve` on a local cluster: Ray's worker niceness (15 by default) is set to 0 so the
    engine is not preempted by Ray's own daemons, no idle Python workers are kept or prestarted
    (each wakes 100 times a second), and Serve's control loop runs every second, not every 0.1 s;
    values the user set are kept."""
    import os

    from serving.common import use_server_cluster_env

    wanted = {
        "RAY_worker_niceness": "0",
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",
        "RAY_num_workers_soft_limit": "0",
        "RAY_prestart_worker_first_driver": "0",
    }
    for name in wanted:
        monkeypatch.delenv(name, raising=False)
    use_server_cluster_env()
    assert {name: os.environ[name] for name in wanted} == wanted
    monkeypatch.setenv("RAY_worker_niceness", "5")
    monkeypatch.setenv("RAY_num_workers_soft_limit", "2")
    use_server_cluster_env()
    assert os.environ["RAY_worker_niceness"] == "5"
    assert os.environ["RAY_num_workers_soft_limit"] == "2"
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "1"


def test_serve_policy_flags_become_the_applications_settings(tiny_model_path):
    """`rayrlhf serve policy`'s flags become ``build_policy_app``'s settings (the benchmark starts
    the server this way): the engine's KV cache size and dtype, the limits the replica enforces.
    (Building the application itself would start Ray: ``ray.serve.llm`` reads the runtime context.)"""
    import argparse

    from serving.cli import add_parser, policy_args
    from serving.policy import POLICY_ARGS, llm_config

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(
        [
            "serve",
            "policy",
            tiny_model_path,
            "--kv-cache-gib",
            "3",
            "--max-n",
            "4",
            "--max-tokens",
            "64",
            "--dtype",
            "float32",
        ]
    )
    args = policy_args(ns)
    assert set(args) <= set(POLICY_ARGS)
    assert (args["kv_cache_gib"], args["dtype"], args["limits"]) == (3, "float32", {"max_tokens": 64, "max_n": 4})
    assert "best_of_n_scorer" not in args
    cfg = llm_config(args["model_path"], kv_cache_gib=args["kv_cache_gib"], dtype=args["dtype"])
    assert cfg.runtime_env["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "3"
    ns = parser.parse_args(
        ["serve", "policy", tiny_model_path, "--best-of-n-scorer", "reward_model", "--scorer-model", "/rm"]
    )
    assert policy_args(ns)["best_of_n_scorer"] == {"function": "reward_model", "model": "/rm"}


def test_engine_metrics_through_ray_are_off_unless_asked_for(tiny_model_path):
    """Exporting the engine's metrics through Ray's metrics costs throughput (docs/benchmarks.md):
    off by default, on with ``engine_metrics``."""
    from serving.policy import llm_config

    assert llm_config(tiny_model_path).log_engine_metrics is False
    assert llm_config(tiny_model_path, engine_metrics=True).log_engine_metrics is True


def test_the_core_binding_set_for_the_server_reaches_its_engine(tiny_model_path, monkeypatch):
    """``VLLM_CPU_OMP_THREADS_BIND`` set where `rayrlhf serve` starts (e.g. all cores but one, to
    leave Ray a core: docs/benchmarks.md) goes into the engine replica's environment, with
    ``threads`` as its OpenMP thread count; unset, vLLM's own choice stands."""
    from serving.policy import llm_config

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in llm_config(tiny_model_path).runtime_env["env_vars"]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-2")
    env = llm_config(tiny_model_path, threads=3).runtime_env["env_vars"]
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("0-2", "3")


def test_sigterm_stops_a_server_as_ctrl_c_does():
    """`rayrlhf serve` turns SIGTERM (a container's or a service manager's stop) into Ctrl-C, so the
    app is deleted and its engines shut down before the cluster stops (Ray's driver handler kills
    the cluster's processes outright). Run in a process of its own: without the handler SIGTERM
    ends that process."""
    import subprocess
    import sys

    code = (
        "import os, signal, time\n"
        "from serving.cli import stop_on_sigterm\n"
        "stop_on_sigterm()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "except KeyboardInterrupt:\n"
        "    print('stopped as by Ctrl-C')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "stopped as by Ctrl-C"), done.stderr[-2000:]


def _serve_policy(*flags: str):
    import argparse

    from serving.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", "policy", "/model", *flags])


def test_a_one_replica_server_on_its_own_cluster_is_answered_by_its_replica_else_by_serves_proxy():
    """`rayrlhf serve policy` with one replica on its own cluster uses Serve's direct ingress (the
    replica listens on --port: tests/ray/test_serving.py); several replicas or a cluster it joins
    (whose processes started without the setting) keep Serve's proxy; asking for direct where it
    cannot be is a clear error, not a server on another port."""
    from serving.cli import choose_ingress

    assert choose_ingress(_serve_policy(), None) == "direct"
    assert choose_ingress(_serve_policy("--replicas", "2"), None) == "proxy"
    assert choose_ingress(_serve_policy(), "10.0.0.1:6379") == "proxy"
    assert choose_ingress(_serve_policy("--ingress", "proxy"), None) == "proxy"
    with pytest.raises(ValueError, match="own cluster"):
        choose_ingress(_serve_policy("--ingress", "direct"), "10.0.0.1:6379")
    with pytest.raises(ValueError, match="one replica"):
        choose_ingress(_serve_policy("--ingress", "direct", "--replicas", "3"), None)


def test_direct_ingress_pins_the_replica_to_the_servers_port_and_releases_it_at_once():
    """The port range Serve allocates from is the one port (its maximum is exclusive), a stopping
    replica drains for a second rather than Serve's 30 (no load balancer to notice), and a released
    port is not quarantined, so a replica replacing a lost one can listen on it again."""
    from serving.common import direct_ingress_env

    env = direct_ingress_env(8123)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert range(
        int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]), int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"])
    ) == range(8123, 8124)
    assert float(env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]) <= 1
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0"


def test_serving_on_a_port_in_use_is_one_clear_line(capsys, monkeypatch):
    """A port another program holds: refused before any cluster starts (the replica would otherwise
    retry its port for ever, the proxy fail without a word to the user)."""
    import socket

    from serving.cli import run

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert run(_serve_policy("--port", str(port))) == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use" in err and len(err.strip().splitlines()) == 1
