"""The roles of one run, started and stopped in one place: learners (a Ray Train worker group),
generators with their scorer and reference (``RolloutGroup``) and, for Q-learning, a replay
buffer. Every recipe gets the same things from here: the tokenizer, the resume point, the
run's ledger, generator restarts that load the learners' current weights, ``placement.json``,
one roles-ready line and a teardown that stops whatever started, in any order of failure.

With ``cluster.layout=colocated`` the learners are placed first (each generator goes to its
learner's node), so a recipe starts the learners before the generators.

The modules: ``rollout_group`` and ``rollout_pool`` (the generators, scorer and reference as a
group, and the work units they share), ``learner_group``, ``learner_spec`` and
``learner_worker`` (the Ray Train side), ``workers`` (the Ray actors around ``actors/``'s
classes), ``placement`` and ``resources`` (where roles go, whether they fit), ``weight_sync``,
``transports`` and ``collective`` (weights to the generators), ``realtime`` (CPU scheduling),
``fault_points`` (where a role can be held open for a kill aimed inside a call).
"""

from __future__ import annotations

import json
from typing import Any

import ray

from cluster.ops.ledger import Ledger
from cluster.run_context import RunContext


class Roles:
    def __init__(self, ctx: RunContext, model_path: str, unit: str = "prompt") -> None:
        from transformers import AutoTokenizer

        self.ctx, self.cfg, self.model_path = ctx, ctx.cfg, model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        tok = self.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.resume = str(ctx.resume_from) if ctx.resume_from else None
        self.ledger = Ledger(ctx.dir, resume_step=ctx.start_step if self.resume else None, unit=unit)
        self.learners: Any = None
        self.rollout: Any = None
        self.replay: Any = None

    def __enter__(self) -> "Roles":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- starting -------------------------------------------------------------------------------
    def start_learners(self, probe_ids: list[int] | None = None) -> Any:
        from cluster.roles.learner_group import LearnerGroup
        from cluster.roles.learner_spec import learner_spec

        spec = learner_spec(self.cfg, self.model_path, self.pad_id, resume_from=self.resume, probe_ids=probe_ids)
        self.learners = LearnerGroup(spec, self.ctx.dir / "ray_train")
        if self.rollout is not None:
            self._weights_from_learners()
        return self.learners

    def start_generators(self, cfg: Any = None, colocate: bool = False) -> Any:
        """The generator pool with its scorer and, where the recipe declares one beside them
        (``RoleSet.reference == "rollout"``), the reference; ``cfg``: the generators' own copy of
        the config (e.g. DPO's candidate sampling). They start from the resumed checkpoint's
        weights when resuming."""
        from cluster.roles.rollout_group import RolloutGroup

        nodes = self.learners.wait_ready()["nodes"] if colocate else None
        self.rollout = RolloutGroup(
            cfg or self.cfg,
            self.model_path,
            policy_path=self.resume,
            policy_version=int(self.ctx.run_state["version"]),
            colocate_nodes=nodes,
        )
        if self.learners is not None:
            self._weights_from_learners()
        return self.rollout

    def _weights_from_learners(self) -> None:
        """A generator that restarts gets the weights the learners hold now."""
        learners = self.learners
        self.rollout.weights_source = lambda: learners.current_weights()["weights"][0]

    def start_replay(self, capacity: int, export_dir: str | None, whole_groups: bool = False) -> Any:
        from cluster.recipes import get_recipe
        from cluster.roles.workers import ReplayWorker

        if not get_recipe(self.cfg.run.algorithm).roles(self.cfg).replay:
            raise RuntimeError(
                f"recipe {self.cfg.run.algorithm} starts a replay buffer it does not declare (RoleSet.replay)"
            )
        self.replay = (
            ray.remote(ReplayWorker)
            .options(num_cpus=0)
            .remote(capacity, self.cfg.run.seed, self.pad_id, export_dir, whole_groups)
        )
        return self.replay

    def ready(self, what: str) -> dict:
        """Waits for every started role, writes ``placement.json`` and prints one line: the roles,
        ``what`` the recipe trains, the trainable fraction and where a resumed run continues."""
        cfg = self.cfg
        if self.rollout is not None:
            self.rollout.wait_ready()
        info = self.learners.wait_ready() if self.learners is not None else {}
        parts = []
        if self.rollout is not None:
            scorer = "the generators as judge" if self.rollout.scorer is None else "1 scorer"
            parts.append(
                f"{len(self.rollout.generators)} generator(s), {scorer}"
                + (", 1 reference" if self.rollout.reference is not None else "")
            )
        if self.learners is not None:
            parts.append(f"{cfg.cluster.num_learners} learner(s)")
        if self.replay is not None:
            parts.append("1 replay buffer")
        line = f"[rayrlhf] roles ready: {', '.join(parts)}; {what}"
        if info:
            line += f"; trainable fraction {info['trainable_fraction']:.4f}"
        if self.resume:
            line += (
                f"; resumed from {self.resume} (step {self.ctx.start_step}, policy version {info.get('version', '?')})"
            )
        print(line, flush=True)
        self._write_placement(info)
        return info

    def _write_placement(self, info: dict) -> None:
        """Where the roles run (multi-node layouts): each generator's node, learner rank 0's node."""
        rollout = self.rollout
        (self.ctx.dir / "placement.json").write_text(
            json.dumps(
                {
                    "layout": self.cfg.cluster.layout,
                    "generators": rollout.nodes() if rollout else [],
                    "learner_rank0": info.get("node"),
                    "learners": info.get("nodes"),
                    "generator_placement_group": rollout is not None and rollout.placement_group is not None,
                    "learner_env": info.get("env"),
                }
            )
        )

    # -- bookkeeping every step -----------------------------------------------------------------
    def record_restarts(self, step: int) -> dict[str, int]:
        """Restarts since the last step into the ledger (each role keeps its own list); returns
        the run's restart counts for the metrics row."""
        logs = []
        if self.rollout is not None:
            logs += [(r, entries) for r, entries in self.rollout.restart_logs().items()]
        if self.learners is not None:
            logs.append(("learner", self.learners.restart_log))
        for role, entries in logs:
            if entries:
                self.ledger.record("restart", [{"step": step, "role": role, "detail": e} for e in entries])
                entries.clear()
        row = {}
        if self.rollout is not None:
            row.update({f"restarts/{k}": v for k, v in self.rollout.restart_counts().items()})
        if self.learners is not None:
            row["restarts/learner"] = self.learners.restarts
        return row

    # -- stopping -------------------------------------------------------------------------------
    def stop_generators(self) -> None:
        if self.rollout is not None:
            self.rollout.shutdown()
            self.rollout = None

    def stop(self) -> None:
        """Stops every role that started (learners first: they may hold a weights group open)."""
        try:
            if self.learners is not None:
                self.learners.stop()
        finally:
            self.stop_generators()
            if self.replay is not None:
                ray.kill(self.replay)
                self.replay = None
