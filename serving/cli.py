"""``rayrlhf serve ...``: the Serve apps from the command line (on the cluster in RAY_ADDRESS, or a
local one), bound to 127.0.0.1 unless ``--host`` says otherwise.

    rayrlhf serve policy MODEL_DIR [--best-of-n-scorer FUNCTION] [--replicas N] [--ingress auto|direct|proxy] ...
    rayrlhf serve scorer (--function F | --reward-model DIR | --judge DIR) ...
    rayrlhf serve trainer [--model NAME=FOLDER ...] [--store DIR]   the Tinker API (docs/tinker.md)
    rayrlhf serve reload URL CHECKPOINT      a running policy server switches to CHECKPOINT

A policy server with one replica on a cluster of its own is answered by that replica on
``--port`` (Serve's direct ingress; Serve's proxy listens on a second port); with several replicas
or on a cluster it joins, by Serve's proxy on ``--port`` (``choose_ingress``).

The API key, when wanted, is read from the environment variable ``--api-key-env`` names
(default RAYRLHF_API_KEY), never from the command line.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from serving.common import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    direct_ingress_env,
    free_port,
    port_is_free,
    use_server_cluster_env,
)


def add_parser(sub: Any) -> None:
    sv = sub.add_parser("serve", help="serve a policy (OpenAI API) or a scorer (/v1/score) with Ray Serve")
    kinds = sv.add_subparsers(dest="app", required=True)
    po = _add_policy_parser(kinds)
    sc = kinds.add_parser("scorer", help="/v1/score over a rule function, reward model or LLM judge")
    what = sc.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--function", help="rule function: a built-in (reasoning_gym, exact_match, ...) or module:function"
    )
    what.add_argument(
        "--reward-model", metavar="DIR", help="a trained reward model (run.algorithm=reward_model checkpoint)"
    )
    what.add_argument("--judge", metavar="DIR", help="an LLM judge (any causal-LM folder)")
    sc.add_argument("--replicas", type=int, default=1)
    sc.add_argument("--max-items", type=int, default=256, help="most samples per request")
    tr = _add_trainer_parser(kinds)
    for p in (po, sc, tr):
        p.add_argument("--host", default=DEFAULT_HOST, help="interface to bind (default loopback only)")
        p.add_argument("--port", type=int, default=DEFAULT_PORT)
        p.add_argument(
            "--api-key-env",
            default="RAYRLHF_API_KEY",
            help="environment variable holding the API key (unset: no key required)",
        )
        p.add_argument("--address", default="", help="Ray cluster to join (default: RAY_ADDRESS, else a local one)")
        p.add_argument(
            "--access-log",
            action="store_true",
            help="Serve's per-request log lines (off by default: they cost throughput)",
        )
    rl = kinds.add_parser("reload", help="switch a running policy server to a newer checkpoint")
    rl.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    rl.add_argument("checkpoint", help="model folder with the served model's architecture")
    rl.add_argument("--api-key-env", default="RAYRLHF_API_KEY")


def _add_policy_parser(kinds: Any) -> Any:
    """``rayrlhf serve policy``'s arguments (the shared ones are added beside the scorer's)."""
    po = kinds.add_parser("policy", help="OpenAI-API policy server over vLLM (ray.serve.llm)")
    po.add_argument("model_path", help="model folder or rayrlhf checkpoint")
    po.add_argument("--model-id", default="policy", help="name clients pass as 'model'")
    po.add_argument("--replicas", type=int, default=1, help="engine replicas")
    po.add_argument("--max-model-len", type=int, default=1024)
    po.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="engine weights; auto: bfloat16 on GPUs and CPUs with native bf16, float32 elsewhere",
    )
    po.add_argument(
        "--kv-cache-gib",
        type=int,
        default=1,
        help="the engine's KV cache on CPU, whole GiB (GPU engines size it from free memory)",
    )
    po.add_argument("--max-tokens", type=int, default=512, help="largest max_tokens a request may ask for")
    po.add_argument("--max-n", type=int, default=8, help="largest n (and best-of-n) a request may ask for")
    po.add_argument(
        "--best-of-n-scorer",
        default="",
        metavar="FUNCTION",
        help="enable /v1/best_of_n ranked by this reward function (a rule, or reward_model with --scorer-model)",
    )
    po.add_argument("--scorer-model", default="", help="reward-model or judge folder of the best-of-n scorer")
    po.add_argument(
        "--ingress",
        choices=("auto", "direct", "proxy"),
        default="auto",
        help="direct: the replica answers HTTP on --port itself (one hop fewer per request); proxy: "
        "Serve's proxy on --port; auto: direct on the server's own cluster with one replica",
    )
    po.add_argument(
        "--engine-metrics",
        action="store_true",
        help="export the engine's metrics through Ray's metrics too (Ray Dashboard; costs throughput)",
    )
    return po


def _add_trainer_parser(kinds: Any) -> Any:
    """``rayrlhf serve trainer``'s own arguments: the Tinker API over LoRA tenants (serving/tinker)."""
    tr = kinds.add_parser("trainer", help="the Tinker API: users' own loops train LoRA adapters (tinker SDK)")
    tr.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=FOLDER",
        help="a base model clients may name (repeat for more; FOLDER: a model folder or built-in asset; "
        "default: smollm2-135m=smollm2-135m)",
    )
    tr.add_argument("--store", default="tinker-store", help="folder of the adapters and saved states")
    tr.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    tr.add_argument("--max-adapters", type=int, default=8, help="most training clients per base model")
    tr.add_argument("--max-rank", type=int, default=64, help="largest LoRA rank a client may ask for")
    tr.add_argument("--max-tokens", type=int, default=512, help="most new tokens a sample may ask for")
    tr.add_argument("--max-model-len", type=int, default=1024, help="longest prompt plus sample")
    return tr


def trainer_args(ns: argparse.Namespace) -> dict[str, Any]:
    """``build_trainer_app``'s args from ``rayrlhf serve trainer``'s flags."""
    from cluster.assets import resolve_model

    models = {}
    for item in ns.model or ["smollm2-135m=smollm2-135m"]:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            raise ValueError(f"--model {item!r} is not NAME=FOLDER")
        models[name] = resolve_model(folder)
    return {
        "models": models,
        "store": os.path.abspath(ns.store),
        "dtype": ns.dtype,
        "max_adapters": ns.max_adapters,
        "max_rank": ns.max_rank,
        "max_tokens": ns.max_tokens,
        "max_model_len": ns.max_model_len,
        "api_key_env": ns.api_key_env,
    }


def _scorer_args(ns: argparse.Namespace) -> dict[str, Any]:
    if getattr(ns, "reward_model", None):
        return {"function": "reward_model", "model": ns.reward_model}
    if getattr(ns, "judge", None):
        return {"function": "llm_judge", "model": ns.judge}
    return {"function": ns.function}


def _reload(ns: argparse.Namespace) -> int:
    import requests

    key = os.environ.get(ns.api_key_env, "")
    r = requests.post(
        ns.url.rstrip("/") + "/v1/admin/reload",
        json={"model_path": os.path.abspath(ns.checkpoint)},
        headers={"Authorization": f"Bearer {key}"} if key else {},
        timeout=600,
    )
    print(r.text)
    return 0 if r.ok else 1


def policy_args(ns: argparse.Namespace) -> dict[str, Any]:
    """``build_policy_app``'s args from ``rayrlhf serve policy``'s flags."""
    args: dict[str, Any] = {
        "model_path": ns.model_path,
        "model_id": ns.model_id,
        "num_replicas": ns.replicas,
        "max_model_len": ns.max_model_len,
        "dtype": ns.dtype,
        "kv_cache_gib": ns.kv_cache_gib,
        "api_key_env": ns.api_key_env,
        "limits": {"max_tokens": ns.max_tokens, "max_n": ns.max_n},
        "access_log": ns.access_log,
        "engine_metrics": ns.engine_metrics,
    }
    if ns.best_of_n_scorer:
        args["best_of_n_scorer"] = {
            "function": ns.best_of_n_scorer,
            **({"model": ns.scorer_model} if ns.scorer_model else {}),
        }
    return args


def stop_on_sigterm() -> None:
    """SIGTERM (a container's, Kubernetes' or a service manager's stop) stops the server as Ctrl-C
    does: the app deleted (Serve stops each replica and its engine), then the local cluster, exit
    status 0. The handler ``ray.init`` installs would kill the cluster's processes outright and
    exit 1 (tried: the process ended by SIGABRT); while the server starts, that one applies."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def choose_ingress(ns: argparse.Namespace, address: str | None) -> str:
    """'direct' (the replica answers on ``--port``: ``serving.common.direct_ingress_env``) or
    'proxy' (Serve's proxy on ``--port``). Direct needs the server's own cluster, whose processes
    start with the setting, and one replica, the one that can listen on the port."""
    wanted = getattr(ns, "ingress", "proxy")
    if wanted == "auto":
        return "direct" if address is None and ns.replicas == 1 else "proxy"
    if wanted == "direct" and address is not None:
        raise ValueError(
            "--ingress direct needs the server's own cluster (no --address / RAY_ADDRESS); on a cluster "
            "you join, Serve's direct ingress is that cluster's setting (docs/kubernetes.md)"
        )
    if wanted == "direct" and ns.replicas != 1:
        raise ValueError(f"--ingress direct serves one replica on --port, not {ns.replicas}; use --ingress proxy")
    return wanted


def _app(ns: argparse.Namespace) -> tuple[Any, str]:
    """A maker of the application ``ns`` asks for, and its name."""
    if ns.app == "policy":
        from serving.policy import build_policy_app

        args = policy_args(ns)
        return (lambda: build_policy_app(args)), "policy"
    if ns.app == "trainer":
        from serving.tinker.app import build_trainer_app

        args = trainer_args(ns)
        return (lambda: build_trainer_app(args)), "trainer"
    from serving.scorer import build_scorer_app

    args = {
        "scorer": _scorer_args(ns),
        "num_replicas": ns.replicas,
        "api_key_env": ns.api_key_env,
        "limits": {"max_items": ns.max_items},
    }
    return (lambda: build_scorer_app(args)), "scorer"


def run(ns: argparse.Namespace) -> int:
    if ns.app == "reload":
        return _reload(ns)
    address = ns.address or os.environ.get("RAY_ADDRESS") or None
    try:
        ingress = choose_ingress(ns, address)
    except ValueError as e:
        print(f"rayrlhf: {e}", file=sys.stderr)
        return 2
    proxy_port = ns.port
    if address is None:
        if not port_is_free(ns.host, ns.port):
            print(f"rayrlhf: port {ns.port} on {ns.host} is in use; pick another with --port", file=sys.stderr)
            return 2
        use_server_cluster_env()
        if ingress == "direct":  # before Ray is imported: Serve reads it at import, in every process
            proxy_port = free_port(ns.host)
            os.environ.update(direct_ingress_env(ns.port))
    import ray
    from ray import serve

    try:
        make, name = _app(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"rayrlhf: {e}", file=sys.stderr)
        return 2
    ray.init(address=address, include_dashboard=False if address is None else None, log_to_driver=True)
    serve.start(http_options={"host": ns.host, "port": proxy_port}, logging_config={"enable_access_log": ns.access_log})
    try:
        serve.run(make(), name=name, route_prefix="/", blocking=False)
    except ValueError as e:
        print(f"rayrlhf: {e}", file=sys.stderr)
        return 2
    key_note = f"API key from ${ns.api_key_env}" if os.environ.get(ns.api_key_env) else "no API key"
    how = f"the replica answers itself; Serve's proxy on port {proxy_port}" if ingress == "direct" else "Serve's proxy"
    print(
        f"[rayrlhf] {name} server on http://{ns.host}:{ns.port} ({how}; {key_note}); Ctrl-C or SIGTERM stops it",
        flush=True,
    )
    stop_on_sigterm()  # after ray.init, which installs its own handler
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.delete(name)
    return 0
