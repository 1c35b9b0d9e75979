"""The run's Ray cluster: joined (``cluster.address``, ``RAY_ADDRESS`` or a head that ``ray
start`` left on this machine) or started for the run; the roles' requests checked against it
before any role starts; one line announcing it; left on close only if this run connected.
``job_runtime_env``: what every worker of the job starts with."""

from __future__ import annotations

import math
import os
from typing import Any

from actors.start_up import SETUP_HOOK


class ClusterConnection:
    """The connection of one run (or of a staged run's every stage). ``cluster``: the run's
    ``cluster`` config section."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.started_cluster = self.connected = False
        self.join_reason = ""
        self.dashboard_url = ""

    def connect(self, requests: list) -> None:
        """Joins the configured / ambient cluster, else starts a local one; then checks that the
        roles' ``requests`` fit it (a request no node can meet would otherwise wait forever)."""
        import ray

        from cluster.roles.resources import check_fits, cluster_node_cpus, cluster_resources

        if not ray.is_initialized():
            self._init_ray(sum(r.count * r.cpus for r in requests))
            self.connected = True  # this run made the connection: ``close`` leaves it
        check_fits(requests, cluster_node_cpus(), cluster_resources())
        self._announce_cluster()

    def _init_ray(self, needed_cpus: float) -> None:
        import ray

        cluster = self.cluster
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Job-wide default for every worker, Ray Train's included: Ray would otherwise pin each
        # process's OpenMP pool to its reserved CPUs (often 1); the roles work one phase at a time.
        env_vars = {
            "RAY_USAGE_STATS_ENABLED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": str(cluster.threads or os.cpu_count() or 1),
        }
        runtime_env = job_runtime_env(env_vars, lighter_gc=cluster.lighter_gc)
        address = cluster.address or os.environ.get("RAY_ADDRESS", "")
        if not address:
            address = running_local_cluster(cluster.temp_dir or None) or ""
            if address:  # a head started by `ray start` on this machine: join it, as `ray job submit` runs do
                self.join_reason = (
                    f"joined the cluster `ray start` left at {address}; "
                    "cluster.address=local starts a run's own instead"
                )
        if address and address != "local":
            self.dashboard_url = ray.init(address=address, runtime_env=runtime_env, log_to_driver=True).dashboard_url
            return
        # A head this run starts is the run's own: its workers (the roles) are the work, not
        # background jobs, so they keep the driver's priority instead of Ray's default nice 15,
        # which starves them beside any other process on the host.
        os.environ.setdefault("RAY_worker_niceness", "0")
        kwargs: dict[str, Any] = dict(
            address="local",
            num_cpus=cluster.num_cpus or max(os.cpu_count() or 1, math.ceil(needed_cpus)),
            include_dashboard=cluster.include_dashboard,
            dashboard_host=cluster.dashboard_host,
            runtime_env=runtime_env,
        )
        if cluster.temp_dir:
            kwargs["_temp_dir"] = cluster.temp_dir
        self.dashboard_url = ray.init(**kwargs).dashboard_url
        self.started_cluster = True

    def _announce_cluster(self) -> None:
        """One line on the cluster (Ray's own start-up messages go to the log file)."""
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        cpus = sum(n["Resources"].get("CPU", 0) for n in nodes)
        ports = sorted({n.get("MetricsExportPort") for n in nodes if n.get("MetricsExportPort")})
        url = self.dashboard_url
        print(
            f"[rayrlhf] Ray cluster: {len(nodes)} node(s), {cpus:g} CPUs"
            + (f"; dashboard http://{url}" if url else "")
            + (f"; Prometheus metrics on port {', '.join(map(str, ports))}" if ports else "")
            + ("" if self.started_cluster else f" (joined{': ' + self.join_reason if self.join_reason else ''})")
            + (" (started for this run)" if self.started_cluster else ""),
            flush=True,
        )

    def close(self) -> None:
        """Leaves the cluster if this run connected (a caller's own connection is kept; a joined
        cluster keeps running, one started for the run stops)."""
        import ray

        if self.connected:
            ray.shutdown()


def job_runtime_env(env_vars: dict[str, str], lighter_gc: bool = True) -> dict[str, Any]:
    """The job's runtime environment: ``env_vars`` for every worker, and (``cluster.lighter_gc``)
    the setup hook that makes each worker's start-up imports cheaper (``actors/start_up.py``)
    unless the job already has a hook of its own (``ray job submit --runtime-env-json``: Ray
    refuses a second one)."""
    from ray._private import ray_constants

    env: dict[str, Any] = {"env_vars": dict(env_vars)}
    if lighter_gc and not os.environ.get(ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR):
        env["worker_process_setup_hook"] = SETUP_HOOK
    return env


def running_local_cluster(temp_dir: str | None = None) -> str | None:
    """The address of a head that `ray start` left running on this machine (Ray's own address
    file in its temp folder), if its GCS answers; None otherwise (also for a stale file).
    ``ray.init()`` without an address would join such a head by itself and then refuse the
    resources a local start passes."""
    import socket

    from ray._private.utils import read_ray_address

    address = read_ray_address(temp_dir)
    if not address or ":" not in address:
        return None
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return address
    except (OSError, ValueError):
        return None
