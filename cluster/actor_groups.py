"""Ray actors around the plain role classes, and the group that places them.

Every method that produces experience returns ``(record, stats)`` with ``num_returns=2``: the
record stays in the object store and flows actor to actor by reference, while the driver only
fetches the small stats dict.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import ray
import torch

from actors.generator import GeneratorConfig
from actors.judge import JudgeConfig
from actors.reference import ReferenceConfig
from actors.remote import RemoteSettings
from actors.scorer import ScorerSpec
from cluster.config import Config
from cluster.rollout_pool import GeneratorPool, Unit, unit_sizes
from cluster.weight_sync import PackedWeights, SyncError, probe_gaps, unpack
from learners.experience import Experience


def _threads(n: int) -> int:
    return n or os.cpu_count() or 1


def peak_rss_gb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def generator_config(cfg: Config, model_path: str, rank: int = 0, initial_version: int = 0) -> GeneratorConfig:
    """The generator's own settings, picked from the run's config."""
    return GeneratorConfig(
        model_path=model_path, dtype=cfg.model.generator_dtype, max_prompt_tokens=cfg.model.max_prompt_tokens,
        max_new_tokens=cfg.model.max_new_tokens, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        samples_per_prompt=cfg.rollout.samples_per_prompt, seed=cfg.run.seed * 1000 + rank,
        kv_cache_gib=cfg.rollout.kv_cache_gib, threads=cfg.rollout.threads, first_core=rank * cfg.rollout.threads,
        system_prompt=cfg.data.system_prompt,
        trust_remote_code=cfg.model.trust_remote_code, initial_version=initial_version,
        max_model_len=cfg.judge.max_prompt_tokens + cfg.judge.max_new_tokens if uses_judge(cfg) else 0,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization if cfg.rollout.gpus_per_generator > 0 else 0.0,
        compile=cfg.rollout.compile,
    )


def uses_judge(cfg: Config) -> bool:
    """Whether the generators also judge (they then need the judge's longer context)."""
    return self_judging(cfg) or (cfg.run.algorithm == "dpo" and cfg.dpo.pairs == "self_judge")


def self_judging(cfg: Config) -> bool:
    """reward.function=llm_judge without a judge model: the policy judges its samples on the generators."""
    return cfg.reward.function == "llm_judge" and not cfg.reward.model


def scorer_spec(cfg: Config) -> ScorerSpec:
    """The scorer role's own settings, picked from the run's config."""
    r = cfg.reward
    spec = ScorerSpec(function=r.function, kwargs=dict(r.kwargs), on_error=r.on_error, model=r.model,
                      batch_size=r.batch_size, max_tokens=cfg.model.max_prompt_tokens + cfg.model.max_new_tokens + 8,
                      system_prompt=cfg.data.system_prompt, threads=_threads(r.threads))
    if r.function == "llm_judge":
        spec.judge = cfg.judge_config()
        spec.judge_engine = GeneratorConfig(
            model_path=r.model, dtype=cfg.model.generator_dtype, max_prompt_tokens=cfg.judge.max_prompt_tokens,
            max_new_tokens=cfg.judge.max_new_tokens, temperature=cfg.judge.temperature, seed=cfg.run.seed + 4242,
            kv_cache_gib=cfg.rollout.kv_cache_gib, threads=r.threads, trust_remote_code=cfg.model.trust_remote_code,
            max_model_len=cfg.judge.max_prompt_tokens + cfg.judge.max_new_tokens)
    if r.function == "remote":
        rem = r.remote
        spec.remote = RemoteSettings(
            url=rem.url, api_key=os.environ.get(rem.api_key_env, "") if rem.api_key_env else "",
            batch_size=rem.batch_size, concurrency=rem.concurrency, timeout_s=rem.timeout_s,
            max_retries=rem.max_retries, backoff_s=rem.backoff_s, max_backoff_s=rem.max_backoff_s,
            on_failure=rem.on_failure, max_wait_s=rem.max_wait_s)
    return spec


def reference_config(cfg: Config, model_path: str) -> ReferenceConfig:
    """The reference's own settings: precision and chunking from the shared ``train`` section."""
    return ReferenceConfig(
        model_path=model_path, bf16=cfg.train.bf16, micro_batch_size=cfg.train.micro_batch_size,
        chunk=cfg.train.logprob_chunk, temperature=cfg.rollout.temperature or 1.0,
        threads=cfg.cluster.threads, trust_remote_code=cfg.model.trust_remote_code,
        shared_prefix=cfg.train.shared_prefix, device="cuda" if cfg.cluster.gpus_per_reference > 0 else "cpu",
    )


class GeneratorWorker:
    def __init__(self, gcfg: GeneratorConfig) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from actors.generator import Generator

        # The engine is built on a thread of its own, and everything that drives it runs there.
        # With a second slot (rollout.inflight_updates) Ray runs calls on its own pool threads; an
        # engine driven from a thread other than the one that built it generated 25-35% slower
        # (benchmarks/rollout.py, actor2). A load or probe that arrives while the engine thread
        # generates is handed to its loop (actors/generator.py).
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="rayrlhf-engine")
        self.gen = self._engine_thread.submit(self._build, Generator, gcfg).result()
        self.gcfg = gcfg

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
        self, rows: list[dict[str, Any]], group_ids: list[int], greedy: bool = False, seed: int | None = None
    ) -> tuple[Experience, dict]:
        g = self.gcfg
        t0 = time.perf_counter()
        exp = self._on_engine(
            self.gen.generate, [r["prompt"] for r in rows], [r["meta"] for r in rows], group_ids,
            max_new_tokens=g.max_new_tokens, max_prompt_tokens=g.max_prompt_tokens,
            temperature=0.0 if greedy else g.temperature,
            top_p=1.0 if greedy else g.top_p,
            n=1 if greedy else g.samples_per_prompt,
            seed=seed,
        )
        dt = time.perf_counter() - t0
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
            "samples": [(r, c) for r, c in zip([m.get("question", "") for m in exp.meta[:2]], exp.completions[:2])],
        }
        return exp, stats

    def generate_texts(self, prompts: list[str], group_ids: list[int], n: int, temperature: float,
                       seed: int | None = None) -> tuple[Experience, dict]:
        """``n`` samples of each text prompt (not task rows), e.g. SPIN's own-generation replies."""
        g = self.gcfg
        t0 = time.perf_counter()
        exp = self._on_engine(self.gen.generate, prompts, [{"prompt": p} for p in prompts], group_ids,
                              max_new_tokens=g.max_new_tokens, max_prompt_tokens=g.max_prompt_tokens,
                              temperature=temperature, n=n, seed=seed)
        return exp, {"seconds": time.perf_counter() - t0, "sequences": exp.batch_size, "skipped": dict(exp.skipped)}

    def judge(self, exp: Experience, jcfg: JudgeConfig, seed: int | None = None) -> tuple[Experience, dict]:
        """Scores each row's (prompt, completion) with this engine as the judge (``actors/judge.py``).
        Rows without a valid judgement are removed and counted as ``unjudged`` (a record never
        holds a NaN score)."""
        from actors.judge import Judge

        t0 = time.perf_counter()
        prompts = [m.get("prompt") or m.get("question", "") for m in exp.meta]
        scores, counts, replies = self._on_engine(Judge(jcfg).judge, self.gen, prompts, exp.completions, seed=seed)
        keep = [i for i, v in enumerate(scores) if not math.isnan(v)]
        skipped = {**exp.skipped, "unjudged": exp.skipped.get("unjudged", 0) + exp.batch_size - len(keep)}
        out = exp.select(keep).replace(scores=torch.tensor([scores[i] for i in keep], dtype=torch.float32),
                                       skipped=skipped).validate()
        stats = {"seconds": time.perf_counter() - t0, "counts": counts, "scores": [scores[i] for i in keep],
                 "skipped": skipped, "groups": out.group_ids.tolist(),
                 "samples": [(p, r) for p, r in zip(exp.completions[:2], replies[:2])],
                 "peak_rss_gb": peak_rss_gb()}
        return out, stats

    def load_weights(self, packed: list[PackedWeights]) -> float:
        """``packed`` arrives wrapped in a list so that Ray hands over the ref, not a copy."""
        p = ray.get(packed[0]) if isinstance(packed[0], ray.ObjectRef) else packed[0]
        return self._beside_engine(self.gen.load_weights, unpack(p), p.version)

    def version(self) -> int:
        return self.gen.version

    # -- the collective transport (``cluster/transports.py``) ------------------------------------
    def join_weight_group(self, host: str, port: int, rank: int, world: int, backend: str = "gloo") -> bool:
        """Joins the broadcast group of learner rank 0 and the generators (blocks until all joined)."""
        from cluster.collective import join

        self.weight_group = join(host, port, rank, world, backend=backend)
        return True

    def receive_weights(self, layout: list, dtype: str, total: int, version: int, bucket_bytes: int) -> float:
        """Receives the learner's broadcast into a buffer kept between syncs (on the group's
        device: host memory for gloo, this generator's GPU for NCCL) and loads it."""
        from cluster.collective import broadcast_buffer
        from cluster.weight_sync import carrier_tensor_dtype, unpack_flat

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


def _version_counts(exp: Experience) -> dict[int, int]:
    if exp.token_versions is None:
        return {exp.policy_version: int(exp.response_mask.sum())}
    versions, counts = exp.token_versions[exp.response_mask].unique(return_counts=True)
    return {int(v): int(c) for v, c in zip(versions, counts)}


class ScorerWorker:
    def __init__(self, spec: ScorerSpec) -> None:
        from actors.scorer import build_scorer

        self.scorer = build_scorer(spec)

    def score(self, exp: Experience) -> tuple[Experience, dict]:
        t0 = time.perf_counter()
        out = self.scorer.score(exp)
        return out, {"seconds": time.perf_counter() - t0, "scores": out.scores.tolist(), "skipped": dict(out.skipped),
                     "groups": out.group_ids.tolist(),
                     "metrics": dict(self.scorer.last_metrics), "peak_rss_gb": peak_rss_gb()}

    def pid(self) -> int:
        return os.getpid()


class ReferenceWorker:
    def __init__(self, rcfg: ReferenceConfig) -> None:
        from actors.reference import Reference

        torch.set_num_threads(_threads(rcfg.threads))
        self.ref = Reference.from_config(rcfg)

    def annotate(self, exp: Experience) -> tuple[Experience, dict]:
        out, dt = self.ref.annotate(exp)
        return out, {"seconds": dt, "peak_rss_gb": peak_rss_gb()}

    def pid(self) -> int:
        return os.getpid()


class ReplayWorker:
    """The replay buffer of Q-learning as an actor: scored experience arrives by reference and is
    kept as token transitions (each step's also written to ``export_dir``, which is what a resumed
    run refills from); sampled batches leave by reference to the learners. The driver only sees
    counts."""

    def __init__(self, capacity: int, seed: int, pad_token_id: int, export_dir: str | None = None) -> None:
        from actors.replay import ReplayBuffer

        self.buffer = ReplayBuffer(capacity, seed)
        self.pad_token_id = pad_token_id
        self.export_dir = export_dir

    def add(self, exps: list, step: int) -> dict:
        """``exps``: records (one per generator) wrapped in a list, so Ray hands over refs."""
        from actors.transitions import transitions_from_experience, write_transitions

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

        from actors.transitions import read_transitions

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

    def sample(self, n: int, step: int) -> Experience:
        from actors.transitions import transitions_to_experience

        return transitions_to_experience(self.buffer.sample(n, step), self.pad_token_id)

    def stats(self) -> dict:
        return self.buffer.stats()


def export_transitions(exp: Experience, path: str) -> dict:
    """A Ray task (``ray.remote(export_transitions)``): one scored record as a Parquet file of
    token transitions, written where the record lives (the driver never fetches it)."""
    from actors.transitions import export_experience

    return export_experience(exp, path)


# glibc malloc settings (read once, at process start) for processes that train or score on the
# CPU. By default glibc serves every block over 32 MiB with its own mmap and unmaps it on free,
# so each logits or activation tensor of every micro-batch faults in fresh zeroed pages: on a
# GRPO update of SmolLM2-135M that was about a quarter of the time. One arena (Ray Train runs the
# training function on a thread of its own, whose arena could not hold such blocks), no mmap and
# no trimming keep freed blocks in the heap for the next micro-batch to reuse.
KEEP_FREED_MEMORY_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**40),
}


def role_env(threads: int, keep_freed_memory: bool = False) -> dict:
    """Runtime env of an inference actor. Ray sets OMP_NUM_THREADS to the CPUs an actor
    reserves (1 for a fractional reservation); OpenMP reads it once at start-up, and vLLM's CPU
    worker then runs single-threaded whatever torch is told later. The phases of a step run one
    after another, so each role may use every core of the node while it works.
    ``keep_freed_memory``: with ``KEEP_FREED_MEMORY_ENV`` (a role computing on the CPU)."""
    return {"env_vars": {
        "OMP_NUM_THREADS": str(_threads(threads)),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        **(KEEP_FREED_MEMORY_ENV if keep_freed_memory else {}),
    }}


class RolloutGroup:
    """The inference-side roles: N generators, one scorer, one reference."""

    def __init__(self, cfg: Config, model_path: str, policy_path: str | None = None, policy_version: int = 0,
                 with_reference: bool | None = None, colocate_nodes: list[str] | None = None) -> None:
        """``policy_path``/``policy_version``: weights the generators start from when they are not
        the initial model (a resumed run's checkpoint); the reference always scores ``model_path``.
        ``with_reference``: start a Reference actor (default: when a PPO KL term needs one).
        ``colocate_nodes``: the learner ranks' nodes, with ``cluster.layout=colocated``
        (``cluster/placement.py``)."""
        from cluster import placement

        self.cfg = cfg
        gen_cls = ray.remote(GeneratorWorker)
        if colocate_nodes:
            self.placement_group, where = None, placement.colocated_options(cfg.rollout.num_generators, colocate_nodes)
        else:
            self.placement_group, where = placement.reserve_generators(cfg)
        # Restarted by Ray after a crash; a restarted generator starts from its constructor's weights
        # and is brought to the current ones by ``recover``. With in-flight updates a second slot
        # takes weight loads and probes while the first generates (``actors/generator.py``).
        slots = 2 if cfg.rollout.inflight_updates else 1
        self.generators = [
            gen_cls.options(runtime_env=role_env(cfg.rollout.threads), max_restarts=cfg.rollout.max_restarts,
                            max_concurrency=slots, **where[i]).remote(generator_config(cfg, policy_path or model_path, i, policy_version))
            for i in range(cfg.rollout.num_generators)
        ]
        # reward.function=llm_judge without a judge model: the generators judge (no scorer actor).
        # The scorer and the reference hold no run state: Ray restarts one that dies, and the
        # work it had in hand is done again (``_redo_lost``).
        self.scorer = None if self_judging(cfg) else ray.remote(ScorerWorker).options(
            num_cpus=cfg.reward.cpus, runtime_env=role_env(cfg.reward.threads),
            max_restarts=cfg.cluster.actor_max_restarts).remote(scorer_spec(cfg))
        # With LoRA the learner scores the reference itself (its base model, adapter disabled):
        # no second copy of the weights, so no reference actor.
        # Without any KL term (beta = 0) nothing needs the reference, so it is not started.
        # The policy version the generators hold (None: unknown), and a callable that returns a
        # reference to the current packed weights (set by the recipe: the learners pack them), for
        # a generator that restarted.
        self.version: int | None = policy_version
        self.weights_source: Any = None
        self.restarts = 0
        self.restart_log: list[dict] = []
        # The scorer's and the reference's restarts: counts, and entries for the run's ledger.
        self.actor_restarts = {"scorer": 0, "reference": 0}
        self.actor_restart_log: dict[str, list[dict]] = {"scorer": [], "reference": []}
        self._pids: dict[str, int] = {}
        self.reference = None
        # Generation for ``submit``/``collect``: work units to whichever generator is free; with a
        # scorer actor each finished unit is scored at once (scoring streams behind generation).
        self.pool = GeneratorPool(len(self.generators), self._start_unit,
                                  on_done=None if self.scorer is None else self._score_unit)
        if with_reference is None:
            with_reference = not cfg.lora.enabled and cfg.ppo.uses_reference
        if with_reference:
            self.reference = ray.remote(ReferenceWorker).options(
                num_cpus=cfg.cluster.cpus_per_reference, num_gpus=cfg.cluster.gpus_per_reference,
                max_restarts=cfg.cluster.actor_max_restarts,
                runtime_env=role_env(cfg.cluster.threads, keep_freed_memory=cfg.cluster.keep_freed_memory
                                     and not cfg.cluster.gpus_per_reference),
            ).remote(reference_config(cfg, model_path))

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
            unscored, out, stats = [u.exp for u in units], [u.handed_on[0] for u in units], [u.handed_on[1] for u in units]
        else:
            unscored = list(exp_refs)
            calls = [self.scorer.score.options(num_returns=2).remote(e) for e in unscored]
            out, stats = [c[0] for c in calls], [c[1] for c in calls]
        return self._redo_lost("scorer", self.scorer.score, unscored, out, stats)

    def annotate_checked(self, exp_refs: list) -> tuple[list, list[dict]]:
        """``annotate_reference`` and its stats, each record annotated again if the reference died."""
        out, stats = self.annotate_reference(exp_refs)
        if self.reference is None:
            return out, []
        return self._redo_lost("reference", self.reference.annotate, list(exp_refs), out, stats)

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
        while True:
            try:
                pid = ray.get(actor.pid.remote(), timeout=60)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                gone = isinstance(e, ray.exceptions.ActorDiedError) and "max_restarts" in str(e).lower()
                if gone or time.time() - t0 > timeout_s:
                    raise RuntimeError(f"the {role} died and did not come back (cluster.actor_max_restarts="
                                       f"{self.cfg.cluster.actor_max_restarts}): {e}") from e
                time.sleep(0.5)
        if pid == self._pids.get(role):
            return
        self._pids[role] = pid
        self.actor_restarts[role] += 1
        self.actor_restart_log[role].append({"reason": reason, "seconds": round(time.time() - t0, 2)})
        print(f"[rayrlhf] the {role} died ({reason}); Ray restarted it (restart {self.actor_restarts[role]} of at "
              f"most {self.cfg.cluster.actor_max_restarts})", flush=True)

    def nodes(self) -> list[str]:
        """The Ray node of each generator."""
        return ray.get([g.node.remote() for g in self.generators])

    def assignment(self, group_ids: list[int]) -> list[list[int]]:
        """The group ids of each work unit of ``submit`` (in unit order)."""
        return [u.group_ids for u in self._units(group_ids, group_ids, False, None)]

    def _units(self, rows: list, group_ids: list[int], greedy: bool, seed: int | None,
               texts: tuple[int, float] | None = None) -> list[Unit]:
        sizes = unit_sizes(len(rows), len(self.generators), self.cfg.rollout.unit_prompts)
        units, start = [], 0
        for k, n in enumerate(sizes):
            units.append(Unit(k, rows[start:start + n], group_ids[start:start + n], greedy,
                              None if seed is None else seed + 7919 * k, texts=texts))
            start += n
        return units

    def _start_unit(self, i: int, unit: Unit) -> tuple:
        if unit.texts is not None:
            n, temperature = unit.texts
            return self.generators[i].generate_texts.options(num_returns=2).remote(
                unit.rows, unit.group_ids, n, temperature, unit.seed)
        return self.generators[i].generate.options(num_returns=2).remote(unit.rows, unit.group_ids, unit.greedy, unit.seed)

    def _score_unit(self, unit: Unit) -> tuple | None:
        if unit.texts is not None:  # text prompts have no task to score against
            return None
        return tuple(self.scorer.score.options(num_returns=2).remote(unit.exp))

    def judge(self, exp_refs: list, seed: int | None = None) -> tuple[list, list[dict]]:
        """Each record (a work unit's) judged by a generator, round robin: the judge is the
        generators' current weights, which they all hold (see ``actors/judge.py``). Waits for the
        judgements; a generator that dies is restarted (``recover``) and its records judged again."""
        jcfg = self.cfg.judge_config()
        n = len(self.generators)

        def call(i: int, record: Any) -> Any:
            return self.generators[i % n].judge.options(num_returns=2).remote(
                record, jcfg, None if seed is None else seed + 7919 * i)

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

    def generate_texts(self, prompts: list[str], group_ids: list[int], n: int, temperature: float,
                       seed: int | None = None, on_reissue: Any = None) -> tuple[list, list[dict]]:
        """``n`` samples of each text prompt (SPIN's demonstrations) through the pool, like
        ``generate_checked``: work units by load, re-issued when a generator dies, seeded by unit."""
        return self.collect(self.submit(prompts, group_ids, seed=seed, texts=(n, temperature)), on_reissue)

    def annotate_reference(self, exp_refs: list) -> tuple[list, list]:
        if self.reference is None:
            return exp_refs, []
        pairs = [self.reference.annotate.options(num_returns=2).remote(e) for e in exp_refs]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def generate_checked(self, rows: list[dict], group_ids: list[int], greedy: bool = False, seed: int | None = None,
                         on_reissue: Any = None) -> tuple[list, list[dict]]:
        """``submit`` then ``collect``: the records and stats of every work unit, in unit order,
        surviving a generator that dies (its unit is issued again, same rows and seed, to a
        survivor or to the generator once Ray restarted it with the current weights).
        ``seed`` reseeds the samplers (unit k: ``seed + 7919 k``); ``on_reissue(generator_index,
        group_ids, error)`` is told of each re-issue."""
        return self.collect(self.submit(rows, group_ids, greedy, seed), on_reissue)

    def submit(self, rows: list, group_ids: list[int], greedy: bool = False, seed: int | None = None,
               texts: tuple[int, float] | None = None) -> dict:
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
            raise RuntimeError(f"generator {i} died ({reason}) and rollout.max_restarts="
                               f"{self.cfg.rollout.max_restarts} allows no more restarts ({self.restarts - 1} so far)")
        print(f"[rayrlhf] generator {i} died ({reason}); waiting for Ray to restart it", flush=True)
        gen, t0 = self.generators[i], time.time()
        while True:
            try:
                ray.get(gen.ready.remote(), timeout=60)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                if isinstance(e, ray.exceptions.ActorDiedError) and "max_restarts" in str(e).lower() \
                        or time.time() - t0 > timeout_s:
                    raise RuntimeError(f"generator {i} did not come back: {e}") from e
                time.sleep(1.0)
        held = ray.get(gen.version.remote())
        source = weights_source or self.weights_source
        if held != self.version:
            if source is None:
                raise RuntimeError(f"generator {i} restarted with policy version {held} and this run has no source "
                                   f"of the current weights (version {self.version})")
            ray.get(gen.load_weights.remote([source()]))
            held = ray.get(gen.version.remote())
            if self.version is not None and held != self.version:
                raise RuntimeError(f"generator {i} restarted with policy version {held}, the others hold {self.version}")
        self.pool.revive(i)
        self.restart_log.append({"generator": i, "reason": reason, "seconds": round(time.time() - t0, 2),
                                 "version": held})
        print(f"[rayrlhf] generator {i} restarted in {time.time() - t0:.1f}s with policy version {held}", flush=True)

    def verify_sync(self, probe_ids: list[int], expected: list[float], version: int, tolerance: float) -> dict[str, float]:
        """Checks that every generator serves the weights the learners sent: it holds ``version``
        and its log-probs of the probe match the learner's (``expected``) within ``tolerance``
        (mean |difference|), and the generators match each other. Raises SyncError naming the
        generators that do not."""
        served = ray.get([g.probe.remote(probe_ids) for g in self.generators])
        gaps = probe_gaps(expected, [s["logprobs"] for s in served])
        spread = max(probe_gaps(served[0]["logprobs"], [s["logprobs"] for s in served[1:]]), default=0.0)
        problems = [f"generator {i} holds policy version {s['version']}, not {version}"
                    for i, s in enumerate(served) if s["version"] != version]
        problems += [f"generator {i} serves log-probs {gap:.4g} nats from the learner's (mean over "
                     f"{len(expected)} probe tokens; tolerance {tolerance:g})"
                     for i, gap in enumerate(gaps) if not gap <= tolerance]
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
        from cluster.placement import release

        self.pool.close()
        for a in [*self.generators, self.scorer, self.reference]:
            if a is not None:
                ray.kill(a)
        release(self.placement_group)
