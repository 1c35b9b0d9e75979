"""The inference-side roles of a run as one group: N generators (a work-unit pool), the scorer
and the reference; their placement, restarts (a role that dies is brought back and its work done
again), scoring, judging, reference annotation and weight syncs with their verification.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from cluster.config import Config
from cluster.config.role_settings import generator_config, reference_config, role_env, scorer_spec, self_judging
from cluster.roles.rollout_pool import GeneratorPool, Unit, unit_sizes
from cluster.roles.weight_sync import SyncError, probe_gaps
from cluster.roles.workers import EpisodeJournal, GeneratorWorker, ReferenceWorker, ScorerWorker


def _episode_journal(cfg: Config) -> Any:
    """Multi-turn episodes' turn-boundary snapshots, in an actor apart from the generators so that
    a unit issued again after its generator died goes on from there (None without episodes)."""
    if not cfg.env.name:
        return None
    return ray.remote(EpisodeJournal).options(num_cpus=0, max_restarts=cfg.cluster.actor_max_restarts).remote()


class RolloutGroup:
    """The inference-side roles: N generators, one scorer, one reference."""

    def __init__(
        self,
        cfg: Config,
        model_path: str,
        policy_path: str | None = None,
        policy_version: int = 0,
        with_reference: bool | None = None,
        colocate_nodes: list[str] | None = None,
    ) -> None:
        """``policy_path``/``policy_version``: weights the generators start from when they are not
        the initial model (a resumed run's checkpoint); the reference always scores ``model_path``.
        ``with_reference``: start a Reference actor (default: when the recipe declares one there).
        ``colocate_nodes``: the learner ranks' nodes, with ``cluster.layout=colocated``
        (``cluster/roles/placement.py``)."""
        from cluster.roles import placement

        self.cfg = cfg
        gen_cls = ray.remote(GeneratorWorker)
        if colocate_nodes:
            self.placement_group, where = None, placement.colocated_options(cfg.rollout.num_generators, colocate_nodes)
        else:
            self.placement_group, where = placement.reserve_generators(cfg)
        # Restarted by Ray after a crash; a restarted generator starts from its constructor's weights
        # and is brought to the current ones by ``recover``. With in-flight updates a second slot
        # takes weight loads and probes while the first generates (``actors/rollout/generator.py``).
        slots = 2 if cfg.rollout.inflight_updates else 1
        self.generators = [
            gen_cls.options(
                runtime_env=role_env(cfg.rollout.threads),
                max_restarts=cfg.rollout.max_restarts,
                max_concurrency=slots,
                **where[i],
            ).remote(generator_config(cfg, policy_path or model_path, i, policy_version, base_model=model_path))
            for i in range(cfg.rollout.num_generators)
        ]
        # reward.function=llm_judge without a judge model: the generators judge (no scorer actor).
        # The scorer and the reference hold no run state: Ray restarts one that dies, and the
        # work it had in hand is done again (``_redo_lost``).
        self.scorer = None if self_judging(cfg) else _start_scorer(cfg)
        # With LoRA the learner scores the reference itself (its base model, adapter disabled):
        # no second copy of the weights, so no reference actor.
        # Without any KL term (beta = 0) nothing needs the reference, so it is not started.
        # The policy version the generators hold (None: unknown), and a callable that returns a
        # reference to the current packed weights (set by the recipe: the learners pack them), for
        # a generator that restarted.
        self.version: int | None = policy_version
        self.weights_source: Any = None
        self.journal = _episode_journal(cfg)
        self._batches = 0
        self.restarts = 0
        self.restart_log: list[dict] = []
        # The scorer's and the reference's restarts: counts, and entries for the run's ledger.
        self.actor_restarts = {"scorer": 0, "reference": 0}
        self.actor_restart_log: dict[str, list[dict]] = {"scorer": [], "reference": []}
        self._pids: dict[str, int] = {}
        self.reference = None
        # Generation for ``submit``/``collect``: work units to whichever generator is free; with a
        # scorer actor each finished unit is scored at once (scoring streams behind generation).
        self.pool = GeneratorPool(
            len(self.generators), self._start_unit, on_done=None if self.scorer is None else self._score_unit
        )
        if with_reference if with_reference is not None else _reference_beside_generators(cfg):
            self.reference = _start_reference(cfg, cfg.ppo.teacher or model_path)

    def wait_ready(self) -> list[float]:
        for role, actor in (("scorer", self.scorer), ("reference", self.reference)):
            if actor is not None:
                self._pids[role] = ray.get(actor.pid.remote())
        return ray.get([g.ready.remote() for g in self.generators])

    def restart_logs(self) -> dict[str, list[dict]]:
        """Each role's restarts not yet in the ledger (the caller clears them)."""
        return {"generator": self.restart_log, **self.actor_restart_log}

    def restart_counts(self) -> dict[str, int]:
        return {"generator": self.restarts, **self.actor_restarts}

    def score_checked(self, exp_refs: list, pending: dict | None = None) -> tuple[list, list[dict]]:
        """The records' rewards and the stats (for a ``submit``'s batch, ``pending``, the scores of
        the units scored as they finished). A record whose scorer died on the way is scored again
        once Ray restarted the scorer (``cluster.actor_max_restarts``)."""
        if self.scorer is None:  # reward.function=llm_judge, no judge model: the policy judges itself
            return self.judge(exp_refs)
        if pending is not None:
            units = pending["batch"].units
            unscored, out, stats = (
                [u.exp for u in units],
                [u.handed_on[0] for u in units],
                [u.handed_on[1] for u in units],
            )
        else:
            unscored = list(exp_refs)
            calls = [self.scorer.score.options(num_returns=2).remote(e) for e in unscored]
            out, stats = [c[0] for c in calls], [c[1] for c in calls]
        return self._redo_lost("scorer", self.scorer.score, unscored, out, stats)

    def annotate_checked(self, exp_refs: list) -> tuple[list, list[dict]]:
        """The records with the reference's log-probs (as they are without a reference actor) and
        its stats, each record annotated again if the reference died."""
        if self.reference is None:
            return exp_refs, []
        calls = [self.reference.annotate.options(num_returns=2).remote(e) for e in exp_refs]
        return self._redo_lost(
            "reference", self.reference.annotate, list(exp_refs), [c[0] for c in calls], [c[1] for c in calls]
        )

    def _redo_lost(self, role: str, method: Any, inputs: list, out: list, stats: list) -> tuple[list, list[dict]]:
        """Waits for each call's stats; a call lost with its actor is made again on the restarted
        actor. A restart between calls (nothing lost) is noticed too (a new process id)."""
        out, stats, got = list(out), list(stats), []
        for k, record in enumerate(inputs):
            while True:
                try:
                    got.append(ray.get(stats[k]))
                    break
                except ray.exceptions.RayActorError as e:
                    self._note_restart(role, f"{type(e).__name__} during a call; its records done again")
                    out[k], stats[k] = method.options(num_returns=2).remote(record)
        self._note_restart(role, "between calls; nothing lost")
        return out, got

    def _note_restart(self, role: str, reason: str, timeout_s: float = 600) -> None:
        """Waits until the actor answers; a new process id is one restart (counted once, however
        many calls it cost)."""
        actor = self.scorer if role == "scorer" else self.reference
        t0 = time.time()
        pid = answer_after_restart(
            actor.pid.remote,
            f"the {role} (cluster.actor_max_restarts={self.cfg.cluster.actor_max_restarts})",
            timeout_s,
        )
        if pid == self._pids.get(role):
            return
        self._pids[role] = pid
        self.actor_restarts[role] += 1
        self.actor_restart_log[role].append({"reason": reason, "seconds": round(time.time() - t0, 2)})
        print(
            f"[rayrlhf] the {role} died ({reason}); Ray restarted it (restart {self.actor_restarts[role]} of at "
            f"most {self.cfg.cluster.actor_max_restarts})",
            flush=True,
        )

    def nodes(self) -> list[str]:
        """The Ray node of each generator."""
        return ray.get([g.node.remote() for g in self.generators])

    def assignment(self, group_ids: list[int]) -> list[list[int]]:
        """The group ids of each work unit of ``submit`` (in unit order)."""
        return [u.group_ids for u in self._units(group_ids, group_ids, False, None)]

    def _units(
        self, rows: list, group_ids: list[int], greedy: bool, seed: int | None, texts: tuple[int, float] | None = None
    ) -> list[Unit]:
        sizes = unit_sizes(len(rows), len(self.generators), self.cfg.rollout.unit_prompts)
        units, start = [], 0
        self._batches += 1
        for k, n in enumerate(sizes):
            units.append(
                Unit(
                    k,
                    rows[start : start + n],
                    group_ids[start : start + n],
                    greedy,
                    None if seed is None else seed + 7919 * k,
                    texts=texts,
                    key=f"{self._batches}.{k}",
                )
            )
            start += n
        return units

    def _start_unit(self, i: int, unit: Unit) -> tuple:
        if unit.texts is not None:
            n, temperature = unit.texts
            return (
                self.generators[i]
                .generate_texts.options(num_returns=2)
                .remote(unit.rows, unit.group_ids, n, temperature, unit.seed)
            )
        return (
            self.generators[i]
            .generate.options(num_returns=2)
            .remote(unit.rows, unit.group_ids, unit.greedy, unit.seed, journal=self.journal, unit_key=unit.key)
        )

    def _score_unit(self, unit: Unit) -> tuple | None:
        if unit.texts is not None:  # text prompts have no task to score against
            return None
        return tuple(self.scorer.score.options(num_returns=2).remote(unit.exp))

    def judge(self, exp_refs: list, seed: int | None = None) -> tuple[list, list[dict]]:
        """Each record (a work unit's) judged by a generator, round robin: the judge is the
        generators' current weights, which they all hold (see ``actors/rewards/judge.py``). Waits for the
        judgements; a generator that dies is restarted (``recover``) and its records judged again."""
        jcfg = self.cfg.judge_config()
        n = len(self.generators)

        def call(i: int, record: Any) -> Any:
            return (
                self.generators[i % n]
                .judge.options(num_returns=2)
                .remote(record, jcfg, None if seed is None else seed + 7919 * i)
            )

        calls = [call(i, e) for i, e in enumerate(exp_refs)]
        stats, recovered = [], set()
        for i, record in enumerate(exp_refs):
            while True:
                try:
                    stats.append(ray.get(calls[i][1]))
                    break
                except ray.exceptions.RayActorError as e:
                    if i % n not in recovered:  # its other records' calls died with it: one restart
                        recovered.add(i % n)
                        self.recover(i % n, reason=f"{type(e).__name__} while judging")
                    calls[i] = call(i, record)
        return [c[0] for c in calls], stats

    def generate_texts(
        self,
        prompts: list[str],
        group_ids: list[int],
        n: int,
        temperature: float,
        seed: int | None = None,
        on_reissue: Any = None,
    ) -> tuple[list, list[dict]]:
        """``n`` samples of each text prompt (SPIN's demonstrations) through the pool, like
        ``generate_checked``: work units by load, re-issued when a generator dies, seeded by unit."""
        return self.collect(self.submit(prompts, group_ids, seed=seed, texts=(n, temperature)), on_reissue)

    def generate_checked(
        self,
        rows: list[dict],
        group_ids: list[int],
        greedy: bool = False,
        seed: int | None = None,
        on_reissue: Any = None,
    ) -> tuple[list, list[dict]]:
        """``submit`` then ``collect``: the records and stats of every work unit, in unit order,
        surviving a generator that dies (its unit is issued again, same rows and seed, to a
        survivor or to the generator once Ray restarted it with the current weights).
        ``seed`` reseeds the samplers (unit k: ``seed + 7919 k``); ``on_reissue(generator_index,
        group_ids, error)`` is told of each re-issue."""
        return self.collect(self.submit(rows, group_ids, greedy, seed), on_reissue)

    def submit(
        self,
        rows: list,
        group_ids: list[int],
        greedy: bool = False,
        seed: int | None = None,
        texts: tuple[int, float] | None = None,
    ) -> dict:
        """Starts a generation and returns at once (``collect`` waits for it): the generators work
        while the caller does something else, e.g. the learners train on the previous batch. The
        batch goes out in work units (``rollout.unit_prompts``) to whichever generator is free.
        ``texts=(n, temperature)``: ``rows`` are plain text prompts (see ``generate_texts``)."""
        return {"batch": self.pool.submit(self._units(rows, group_ids, greedy, seed, texts))}

    def collect(self, pending: dict, on_reissue: Any = None) -> tuple[list, list[dict]]:
        """The records and stats of a ``submit``, in unit order. A unit whose generator died goes
        to another (or the same once Ray restarted it and it holds the current weights);
        ``on_reissue(generator, group_ids, error)`` is told of each."""
        batch = pending["batch"]
        while True:
            died = self.pool.wait(batch)
            for g, unit, err in died:
                if on_reissue is not None and unit is not None:
                    on_reissue(g, unit.group_ids, err)
            # Only generators still down need a restart: one revived meanwhile (a weight sync
            # found it dead and restarted it) would otherwise count against max_restarts twice.
            for g in sorted({g for g, _, _ in died} & self.pool.down()):
                err = next(e for d, _, e in died if d == g)
                self.recover(g, reason=type(err).__name__ if err is not None else "died during another batch")
            if not died:
                break
        units = batch.units
        return [u.exp for u in units], [u.result for u in units]

    def recover(self, i: int, reason: str = "", weights_source: Any = None, timeout_s: float = 600) -> None:
        """Waits for generator ``i`` to be restarted by Ray (``rollout.max_restarts``), then loads
        the current weights into it (``weights_source()``: a reference to packed weights)."""
        self.restarts += 1
        if self.restarts > self.cfg.rollout.max_restarts * len(self.generators):
            raise RuntimeError(
                f"generator {i} died ({reason}) and rollout.max_restarts="
                f"{self.cfg.rollout.max_restarts} allows no more restarts ({self.restarts - 1} so far)"
            )
        print(f"[rayrlhf] generator {i} died ({reason}); waiting for Ray to restart it", flush=True)
        gen, t0 = self.generators[i], time.time()
        answer_after_restart(gen.ready.remote, f"generator {i}", timeout_s)
        held = ray.get(gen.version.remote())
        source = weights_source or self.weights_source
        if held != self.version:
            if source is None:
                raise RuntimeError(
                    f"generator {i} restarted with policy version {held} and this run has no source "
                    f"of the current weights (version {self.version})"
                )
            ray.get(gen.load_weights.remote([source()]))
            held = ray.get(gen.version.remote())
            if self.version is not None and held != self.version:
                raise RuntimeError(
                    f"generator {i} restarted with policy version {held}, the others hold {self.version}"
                )
        self.pool.revive(i)
        self.restart_log.append(
            {"generator": i, "reason": reason, "seconds": round(time.time() - t0, 2), "version": held}
        )
        print(f"[rayrlhf] generator {i} restarted in {time.time() - t0:.1f}s with policy version {held}", flush=True)

    def verify_sync(
        self, probe_ids: list[int], expected: list[float], version: int, tolerance: float
    ) -> dict[str, float]:
        """Checks that every generator serves the weights the learners sent: it holds ``version``
        and its log-probs of the probe match the learner's (``expected``) within ``tolerance``
        (mean |difference|), and the generators match each other. Raises SyncError naming the
        generators that do not."""
        served = ray.get([g.probe.remote(probe_ids) for g in self.generators])
        gaps = probe_gaps(expected, [s["logprobs"] for s in served])
        spread = max(probe_gaps(served[0]["logprobs"], [s["logprobs"] for s in served[1:]]), default=0.0)
        problems = [
            f"generator {i} holds policy version {s['version']}, not {version}"
            for i, s in enumerate(served)
            if s["version"] != version
        ]
        problems += [
            f"generator {i} serves log-probs {gap:.4g} nats from the learner's (mean over "
            f"{len(expected)} probe tokens; tolerance {tolerance:g})"
            for i, gap in enumerate(gaps)
            if not gap <= tolerance
        ]
        if len(served) > 1 and not spread <= min(tolerance, 1e-3):
            problems.append(f"the generators' probe log-probs differ by up to {spread:.4g} nats")
        if problems:
            raise SyncError("weight sync failed: " + "; ".join(problems))
        return {"sync/probe_gap": max(gaps), "sync/probe_spread": spread}

    def sync_weights(self, weights_ref, version: int | None = None) -> list[float]:
        """Loads the packed weights into every generator; one that died on the way is restarted
        and given them. ``version``: the policy version they carry."""
        self.version = version
        refs = [g.load_weights.remote([weights_ref]) for g in self.generators]
        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as e:
                self.recover(i, reason=type(e).__name__, weights_source=lambda: weights_ref)
                out.append(0.0)
        return out

    def shutdown(self) -> None:
        from cluster.roles.placement import release

        self.pool.close()
        for a in [*self.generators, self.scorer, self.reference]:
            if a is not None:
                ray.kill(a)
        release(self.placement_group)


def answer_after_restart(call: Any, what: str, timeout_s: float) -> Any:
    """``call()``'s answer once its actor is back: while Ray restarts it a call fails or times
    out and is made again; an actor out of restarts, or ``timeout_s`` spent, raises."""
    t0 = time.time()
    while True:
        try:
            return ray.get(call(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            gone = isinstance(e, ray.exceptions.ActorDiedError) and "max_restarts" in str(e).lower()
            if gone or time.time() - t0 > timeout_s:
                raise RuntimeError(f"{what} died and did not come back: {e}") from e
            time.sleep(0.5)


def _reference_beside_generators(cfg: Config) -> bool:
    """The run's recipe declares a reference actor beside the generators (``RoleSet.reference``)."""
    from cluster.recipes import get_recipe

    return get_recipe(cfg.run.algorithm).roles(cfg).reference == "rollout"


def _start_scorer(cfg: Config) -> Any:
    return (
        ray.remote(ScorerWorker)
        .options(
            num_cpus=cfg.reward.cpus,
            runtime_env=role_env(cfg.reward.threads),
            max_restarts=cfg.cluster.actor_max_restarts,
        )
        .remote(scorer_spec(cfg))
    )


def _start_reference(cfg: Config, model_path: str) -> Any:
    """The Reference actor scoring ``model_path`` (the initial model, or a distillation teacher)."""
    return (
        ray.remote(ReferenceWorker)
        .options(
            num_cpus=cfg.cluster.cpus_per_reference,
            num_gpus=cfg.cluster.gpus_per_reference,
            max_restarts=cfg.cluster.actor_max_restarts,
            runtime_env=role_env(
                cfg.cluster.threads,
                keep_freed_memory=cfg.cluster.keep_freed_memory and not cfg.cluster.gpus_per_reference,
            ),
        )
        .remote(reference_config(cfg, model_path))
    )
