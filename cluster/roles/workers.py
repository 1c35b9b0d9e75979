"""Ray actors around the plain role classes: generator, scorer, reference, replay buffer.

Every method that produces experience returns ``(record, stats)`` with ``num_returns=2``: the
record stays in the object store and flows actor to actor by reference, while the driver only
fetches the small stats dict.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import ray
import torch

from actors.rollout.generator import GeneratorConfig
from actors.rewards.judge import JudgeConfig
from actors.reference import ReferenceConfig
from actors.rewards.scorer_factory import ScorerSpec
from cluster.config.role_settings import _threads
from cluster.roles.fault_points import fault_point
from cluster.roles.weight_sync import PackedWeights, unpack
from learners.experience import Experience


def peak_rss_gb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class GeneratorWorker:
    def __init__(self, gcfg: GeneratorConfig) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from actors.rollout.generator import Generator

        # The engine is built on a thread of its own, and everything that drives it runs there.
        # With a second slot (rollout.inflight_updates) Ray runs calls on its own pool threads; an
        # engine driven from a thread other than the one that built it generated 25-35% slower
        # (benchmarks/rollout.py, actor2). A load or probe that arrives while the engine thread
        # generates is handed to its loop (actors/rollout/generator.py).
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="rayrlhf-engine")
        self.gen = self._engine_thread.submit(self._build, Generator, gcfg).result()
        self.gcfg = gcfg
        # Multi-turn episodes: one environment per episode, their steps on a pool of threads.
        # Agent programs: their endpoint on 127.0.0.1, the programs on the same pool.
        self._make_env = self._env_pool = self._agent = self._endpoint = None
        if gcfg.environment is not None:
            from actors.agents.environments import environment_factory

            self._make_env = environment_factory(gcfg.environment)
        if gcfg.agent:
            from actors.agents.agent_endpoint import resolve_agent
            from actors.agents.agent_server import AgentEndpoint

            self._agent = resolve_agent(gcfg.agent, gcfg.agent_args, gcfg.max_new_tokens)
            self._endpoint = AgentEndpoint(models=tuple(gcfg.agent_models))
        if gcfg.environment is not None or gcfg.agent:
            self._env_pool = ThreadPoolExecutor(gcfg.env_workers, thread_name_prefix="rayrlhf-env")

    @staticmethod
    def _build(cls, gcfg: GeneratorConfig):
        torch.set_num_threads(_threads(gcfg.threads))
        return cls.from_config(gcfg)

    def _on_engine(self, fn, *args, **kwargs):
        return self._engine_thread.submit(fn, *args, **kwargs).result()

    def _beside_engine(self, fn, *args):
        """A load or probe: called here while the engine thread generates (the generator hands it
        to that loop), else run on the engine thread as a call of its own."""
        return fn(*args) if self.gen.generating else self._on_engine(fn, *args)

    def ready(self) -> float:
        return self.gen.startup_s

    def compilation(self) -> dict:
        return self.gen.compilation()

    def generate(
        self,
        rows: list[dict[str, Any]],
        group_ids: list[int],
        greedy: bool = False,
        seed: int | None = None,
        journal: Any = None,
        unit_key: str = "",
    ) -> tuple[Experience, dict]:
        """A work unit's records and stats. ``journal`` (an ``EpisodeJournal`` actor) and
        ``unit_key``: multi-turn episodes report their turn boundaries there, and a unit issued
        again after its generator died goes on from the boundaries its first run reached."""
        fault_point("GeneratorWorker.generate")
        g = self.gcfg
        t0 = time.perf_counter()
        sampling = {
            "temperature": 0.0 if greedy else g.temperature,
            "top_p": 1.0 if greedy else g.top_p,
            "top_k": 0 if greedy else g.top_k,
            "n": 1 if greedy else g.samples_per_prompt,
            "seed": seed,
        }
        episodes: dict = {}
        if self._agent is not None:
            exp, episodes = self._on_engine(
                self.gen.generate_agent_episodes,
                rows,
                group_ids,
                self._agent,
                self._endpoint,
                g.episode_limits,
                pool=self._env_pool,
                timeout_s=g.agent_timeout_s,
                models=tuple(g.agent_models),
                **sampling,
            )
        elif self._make_env is not None:
            try:
                exp, episodes = self._on_engine(
                    self.gen.generate_episodes,
                    rows,
                    group_ids,
                    self._make_env,
                    g.episode_limits,
                    pool=self._env_pool,
                    **sampling,
                    **_journaled(journal, unit_key),
                )
            finally:  # finished or failed for good (a death never gets here): its snapshots are done with
                if journal is not None and unit_key:
                    journal.drop.remote(unit_key)
        else:
            exp = self._on_engine(
                self.gen.generate,
                [r["prompt"] for r in rows],
                [r["meta"] for r in rows],
                group_ids,
                max_new_tokens=g.max_new_tokens,
                max_prompt_tokens=g.max_prompt_tokens,
                **sampling,
            )
        return exp, _unit_stats(exp, episodes, time.perf_counter() - t0)

    def generate_texts(
        self, prompts: list[str], group_ids: list[int], n: int, temperature: float, seed: int | None = None
    ) -> tuple[Experience, dict]:
        """``n`` samples of each text prompt (not task rows), e.g. SPIN's own-generation replies."""
        g = self.gcfg
        t0 = time.perf_counter()
        exp = self._on_engine(
            self.gen.generate,
            prompts,
            [{"prompt": p} for p in prompts],
            group_ids,
            max_new_tokens=g.max_new_tokens,
            max_prompt_tokens=g.max_prompt_tokens,
            temperature=temperature,
            n=n,
            seed=seed,
        )
        return exp, {"seconds": time.perf_counter() - t0, "sequences": exp.batch_size, "skipped": dict(exp.skipped)}

    def judge(self, exp: Experience, jcfg: JudgeConfig, seed: int | None = None) -> tuple[Experience, dict]:
        """Scores each row's (prompt, completion) with this engine as the judge (``actors/rewards/judge.py``).
        Rows without a valid judgement are removed and counted as ``unjudged`` (a record never
        holds a NaN score)."""
        from actors.rewards.judge import Judge

        fault_point("GeneratorWorker.judge")
        t0 = time.perf_counter()
        prompts = [m.get("prompt") or m.get("question", "") for m in exp.meta]
        scores, counts, replies = self._on_engine(Judge(jcfg).judge, self.gen, prompts, exp.completions, seed=seed)
        keep = [i for i, v in enumerate(scores) if not math.isnan(v)]
        skipped = {**exp.skipped, "unjudged": exp.skipped.get("unjudged", 0) + exp.batch_size - len(keep)}
        out = (
            exp.select(keep)
            .replace(scores=torch.tensor([scores[i] for i in keep], dtype=torch.float32), skipped=skipped)
            .validate()
        )
        stats = {
            "seconds": time.perf_counter() - t0,
            "counts": counts,
            "scores": [scores[i] for i in keep],
            "skipped": skipped,
            "groups": out.group_ids.tolist(),
            "samples": [(p, r) for p, r in zip(exp.completions[:2], replies[:2])],
            "peak_rss_gb": peak_rss_gb(),
        }
        return out, stats

    def load_weights(self, packed: list[PackedWeights]) -> float:
        """``packed`` arrives wrapped in a list so that Ray hands over the ref, not a copy."""
        p = ray.get(packed[0]) if isinstance(packed[0], ray.ObjectRef) else packed[0]
        return self._beside_engine(self.gen.load_weights, unpack(p), p.version)

    def version(self) -> int:
        return self.gen.version

    # -- the collective transport (``cluster/roles/transports.py``) ------------------------------------
    def join_weight_group(self, host: str, port: int, rank: int, world: int, backend: str = "gloo") -> bool:
        """Joins the broadcast group of learner rank 0 and the generators (blocks until all joined)."""
        from cluster.roles.collective import join

        self.weight_group = join(host, port, rank, world, backend=backend)
        return True

    def receive_weights(self, layout: list, dtype: str, total: int, version: int, bucket_bytes: int) -> float:
        """Receives the learner's broadcast into a buffer kept between syncs (on the group's
        device: host memory for gloo, this generator's GPU for NCCL) and loads it."""
        from cluster.roles.collective import broadcast_buffer
        from cluster.roles.weight_sync import carrier_tensor_dtype, unpack_flat

        wg, carrier = self.weight_group, carrier_tensor_dtype(dtype)
        buf = getattr(self, "_recv", None)
        if buf is None or buf.numel() != total or buf.dtype != carrier or buf.device != wg.device:
            buf = self._recv = torch.empty(total, dtype=carrier, device=wg.device)
        t0 = time.perf_counter()
        broadcast_buffer(wg, buf, bucket_bytes)
        received = time.perf_counter() - t0
        load = self._beside_engine(self.gen.load_weights, unpack_flat(buf, dtype, layout), version)
        return received + load

    def node(self) -> str:
        """The Ray node this generator runs on."""
        return ray.get_runtime_context().get_node_id()

    def probe(self, token_ids: list[int]) -> dict:
        """The policy version this generator holds and its log-probs of the probe sequence."""
        return {"version": self.gen.version, "logprobs": self._beside_engine(self.gen.probe_logprobs, token_ids)}


class EpisodeJournal:
    """Turn-boundary snapshots of the multi-turn episodes of work units in flight
    (``actors/agents/episodes.py``: ``EpisodeRunner``), by unit and episode, in an actor apart from the
    generators: when a generator dies mid-unit, the unit issued again goes on from them. A unit's
    entries go when it finishes."""

    def __init__(self) -> None:
        self._units: dict[str, dict[int, dict]] = {}

    def record(self, unit: str, episode: int, snapshot: dict) -> None:
        self._units.setdefault(unit, {})[episode] = snapshot

    def get(self, unit: str) -> dict[int, dict]:
        return self._units.get(unit, {})

    def drop(self, unit: str) -> None:
        self._units.pop(unit, None)

    def sizes(self) -> dict[str, int]:
        return {u: len(eps) for u, eps in self._units.items()}


def _journaled(journal: Any, unit_key: str) -> dict:
    """``generate_episodes``' journal arguments: snapshots out to the journal actor (fire and
    forget), and those an earlier run of this unit left (none if the journal cannot answer)."""
    if journal is None or not unit_key:
        return {}
    try:
        resume = ray.get(journal.get.remote(unit_key), timeout=60)
    except (ray.exceptions.RayError, TimeoutError) as e:  # the unit starts from scratch, as it would without
        logging.getLogger("rayrlhf.generator").warning("episode journal unavailable (%s): no resume", e)
        resume = {}
    return {"journal": lambda episode, snap: journal.record.remote(unit_key, episode, snap), "resume": resume}


def _version_counts(exp: Experience) -> dict[int, int]:
    if exp.token_versions is None:
        return {exp.policy_version: int(exp.response_mask.sum())}
    versions, counts = exp.token_versions[exp.response_mask].unique(return_counts=True)
    return {int(v): int(c) for v, c in zip(versions, counts)}


class ScorerWorker:
    def __init__(self, spec: ScorerSpec) -> None:
        from actors.rewards.scorer_factory import build_scorer

        self.scorer = build_scorer(spec)

    def score(self, exp: Experience) -> tuple[Experience, dict]:
        fault_point("ScorerWorker.score")
        t0 = time.perf_counter()
        out = self.scorer.score(exp)
        return out, {
            "seconds": time.perf_counter() - t0,
            "scores": out.scores.tolist(),
            "skipped": dict(out.skipped),
            "groups": out.group_ids.tolist(),
            "metrics": dict(self.scorer.last_metrics),
            "peak_rss_gb": peak_rss_gb(),
        }

    def pid(self) -> int:
        return os.getpid()


class ReferenceWorker:
    def __init__(self, rcfg: ReferenceConfig) -> None:
        from actors.reference import Reference

        torch.set_num_threads(_threads(rcfg.threads))
        self.ref = Reference.from_config(rcfg)

    def annotate(self, exp: Experience) -> tuple[Experience, dict]:
        fault_point("ReferenceWorker.annotate")
        out, dt = self.ref.annotate(exp)
        return out, {"seconds": dt, "peak_rss_gb": peak_rss_gb()}

    def pid(self) -> int:
        return os.getpid()


class ReplayWorker:
    """The replay buffer of Q-learning as an actor: scored experience arrives by reference and is
    kept as token transitions (each step's also written to ``export_dir``, which is what a resumed
    run refills from); sampled batches leave by reference to the learners. The driver only sees
    counts."""

    def __init__(
        self, capacity: int, seed: int, pad_token_id: int, export_dir: str | None = None, whole_groups: bool = False
    ) -> None:
        from actors.data.replay import ReplayBuffer

        self.buffer = ReplayBuffer(capacity, seed, whole_groups)
        self.pad_token_id = pad_token_id
        self.export_dir = export_dir

    def add(self, exps: list, step: int) -> dict:
        """``exps``: records (one per generator) wrapped in a list, so Ray hands over refs."""
        from actors.data.transitions import transitions_from_experience, write_transitions

        rows, skipped = [], {}
        for exp in ray.get(list(exps)):
            r, s = transitions_from_experience(exp)
            rows += r
            for k, n in s.items():
                skipped[k] = skipped.get(k, 0) + n
        if self.export_dir and rows:
            write_transitions(rows, os.path.join(self.export_dir, f"step-{step:06d}.parquet"))
        evicted = self.buffer.add(rows)
        return {"rows": len(rows), "skipped": skipped, "evicted": evicted, **self.buffer.stats()}

    def add_rows(self, rows: list) -> dict:
        return {"rows": len(rows), "evicted": self.buffer.add(rows), **self.buffer.stats()}

    def refill(self, folder: str, upto_step: int) -> dict:
        """A resumed run's buffer: the exported steps up to its checkpoint, in order (the same
        rows, the same evictions as the interrupted run)."""
        import re

        from actors.data.transitions import read_transitions

        files, later = [], []
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            match = re.fullmatch(r"step-(\d{6})(-\d+)?\.parquet", name)
            if match:
                (files if int(match.group(1)) <= upto_step else later).append(os.path.join(folder, name))
        for f in files:
            self.buffer.add(read_transitions(f)[0])
        # Steps the interrupted run took after its checkpoint: the resumed run takes them again
        # and writes them anew (a stale file could otherwise be refilled by a later resume).
        for f in later:
            os.remove(f)
        return {"files": len(files), "removed_after_checkpoint": len(later), **self.buffer.stats()}

    def sampled(self, n: int, step: int) -> list[int]:
        """The buffer positions ``sample(n, step)`` draws (offline: rows of the transition file's
        training split, in the order they were added)."""
        return self.buffer.sample_indices(n, step)

    def sample(self, n: int, step: int) -> Experience:
        from actors.data.transitions import transitions_to_experience

        return transitions_to_experience(self.buffer.sample(n, step), self.pad_token_id)

    def stats(self) -> dict:
        return self.buffer.stats()


def export_transitions(exp: Experience, path: str) -> dict:
    """A Ray task (``ray.remote(export_transitions)``): one scored record as a Parquet file of
    token transitions, written where the record lives (the driver never fetches it)."""
    from actors.data.transitions import export_experience

    return export_experience(exp, path)


def _unit_stats(exp: Experience, episodes: dict, dt: float) -> dict:
    """What a generator reports of a finished work unit beside its records."""
    lengths = exp.response_lengths()
    stats = {
        "seconds": dt,
        "tokens": int(lengths.sum()),
        "sequences": exp.batch_size,
        "response_lengths": lengths.tolist(),
        "truncated": int(exp.truncated.sum()),
        "skipped": dict(exp.skipped),
        "policy_version": exp.policy_version,
        # Response tokens per weight version that sampled them (several when a load landed mid-call).
        "token_versions": _version_counts(exp),
        "groups": exp.group_ids.tolist(),
        "peak_rss_gb": peak_rss_gb(),
        "episodes": episodes,
        # Per sample (as "groups"): turns taken over from an interrupted run of the unit.
        "resumed_turns": [int((m.get("episode") or {}).get("resumed_turns", 0)) for m in exp.meta]
        if episodes.get("resumed")
        else [],
        "samples": [(r, c) for r, c in zip([m.get("question", "") for m in exp.meta[:2]], exp.completions[:2])],
    }
    return stats
