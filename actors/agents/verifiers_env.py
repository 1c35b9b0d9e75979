"""``verifiers`` environments (prime-rl's environment library) as the rollout, run as they are.

``env.name: verifiers:<taskset id or module>`` loads an environment with the package's own
loader (``vf.load_environment``: the taskset module's ``Taskset``, and its ``Env`` when it
exports one, else the single-agent one), ``env.args`` overriding its config. Its taskset is the
prompt set (``data.train_size`` / ``data.eval_size`` rows of it). Each episode is the package's
own rollout, ``env.run_episode(task, ctx)``: its ``Env.run`` logic (one reply, several user
turns, tools served over MCP and called by its harness), whose model calls reach the
generator's agent endpoint (``actors/agents/agent_endpoint.py``) through the package's interception
server. So, as for every agent program, the trained ids are the ids the engine sampled, the
calls of an episode joined into trajectories. Its rubric scores the episode: the reward is the
trace's (the weighted sum), and each reward function's score and each metric is logged as a
component (``episode/reward/<name>/mean``, ``episode/metric/<name>/mean``).

Run here, not in the package's sandboxes: the seat's harness defaults to ``null`` (its chat
program, MCP tools only) on the ``subprocess`` runtime. That chat program is a PEP 723 script
that the package prepares with ``uv``; its dependencies are this package's own, so it runs on
this interpreter instead (no ``uv``, no download: ``_run_chat_program_here``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from typing import Any

#: The model name the environment's calls carry (the endpoint answers to it).
MODEL = "policy"
API_KEY_VAR = "RAYRLHF_VERIFIERS_ENDPOINT_KEY"
#: What a seat runs on unless env.args says otherwise: this host, the package's chat program.
LOCAL_SEAT = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def plugin_id(env_id: str) -> str:
    """The id the package's loader imports: ``env_id`` itself (an installed environment: its
    module name, ``reverse-text`` -> ``reverse_text``), or for a dotted module path
    (``my_pkg.envs.math``, which the loader cannot import: it looks for it inside its own
    namespace first) that module, imported here, under a top-level alias."""
    import importlib

    if "." not in env_id or "/" in env_id:
        return env_id
    alias = "rayrlhf_verifiers__" + env_id.replace(".", "__")
    if alias not in sys.modules:
        sys.modules[alias] = importlib.import_module(env_id)
    return alias


def load_environment(env_id: str, args: dict[str, Any]) -> Any:
    """The package's environment for ``env_id`` with ``args`` over its config; its ``agent``
    seat (where it has one) local unless ``args`` place it. ValueError naming what is wrong."""
    import verifiers.v1 as vf
    from pydantic import ValidationError

    named = env_id
    try:
        env_id = plugin_id(env_id)
    except ImportError as e:
        raise ValueError(f"verifiers:{named}: {e}") from None
    raw = _merged({"taskset": {"id": env_id}}, args)
    try:
        cls = vf.env_config_type(env_id, raw.get("id") or "")
    except Exception as e:  # the package's loader: an id that imports nothing, no Taskset in it
        raise ValueError(f"verifiers:{named}: {type(e).__name__}: {e}") from None
    if "agent" in cls.model_fields:
        raw = _merged({"agent": LOCAL_SEAT}, raw)
    try:
        return vf.load_environment(vf.resolve_env_config(raw))
    except ValidationError as e:
        errors = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()[:3])
        raise ValueError(f"verifiers:{named}: env.args: {errors}") from None
    except (ValueError, TypeError, ImportError) as e:
        raise ValueError(f"verifiers:{named}: {type(e).__name__}: {e}") from None


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    texts = [m.get("content") if isinstance(m, dict) else getattr(m, "content", "") for m in prompt or []]
    return "\n".join(t for t in texts if isinstance(t, str))


def task_rows(env: Any) -> list[dict[str, Any]]:
    """The taskset's tasks as prompt rows (``meta["verifiers_task"]``: the task's index)."""
    rows = []
    for i, task in enumerate(env.taskset):
        data = task.data
        answer = str(getattr(data, "answer", "") or "")
        prompt = _prompt_text(data.prompt)
        rows.append(
            {
                "prompt": prompt,
                "answer": answer,
                "meta": {
                    "verifiers_task": i,
                    "task_id": str(data.id),
                    "answer": answer,
                    "question": prompt,
                    "prompt": prompt,
                },
            }
        )
    return rows


def _run_chat_program_here() -> None:
    """Registers this interpreter for the package's chat program (its PEP 723 script), which
    the subprocess runtime would otherwise prepare with ``uv sync`` (and, without ``uv``,
    download it). Its dependencies (openai, mcp, httpx...) are the package's own."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = os.path.join(SubprocessRuntime.scripts_dir, f"{hashlib.sha256(data).hexdigest()}.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path) or open(path, "rb").read() != data:
        with open(path, "wb") as f:
            f.write(data)
    SubprocessRuntime._interpreters[path] = sys.executable


def _children_import_what_this_process_imports() -> None:
    """The package runs an environment's tool servers as ``python -m <module>`` processes: they
    get this process's import path (``PYTHONPATH``), so a module this process imported (a test's,
    a job's working directory) imports there too."""
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(current + paths))


class VerifiersProgram:
    """The agent program of ``env.name: verifiers:...``: one episode of the environment's own
    rollout against the episode's endpoint; returns the rubric's reward and its components."""

    def __init__(self, env_id: str, args: dict[str, Any], max_tokens: int, keep_traces: bool = False) -> None:
        self.env_id, self.args, self.max_tokens = env_id, dict(args), max_tokens
        # keep_traces: each episode's trace by its base URL (for a caller that inspects them).
        self.traces: dict[str, Any] | None = {} if keep_traces else None
        self.env: Any = None
        self.tasks: list[Any] = []
        self._serving: Any = None
        self._lock: asyncio.Lock | None = None

    async def _ready(self) -> None:
        """Loads the environment and opens its serving context (interception server, shared
        tool servers) once, on the programs' event loop, where it stays open."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.env is None:
                _run_chat_program_here()
                _children_import_what_this_process_imports()
                os.environ.setdefault(API_KEY_VAR, "unused")  # the endpoint's token is in its URL
                env = load_environment(self.env_id, self.args)
                self.tasks = list(env.taskset)
                self._serving = env.serving()
                await self._serving.__aenter__()
                self.env = env

    async def __call__(self, row: dict[str, Any], base_url: str) -> dict[str, Any]:
        import verifiers.v1 as vf

        await self._ready()
        task = self.tasks[int(row["meta"]["verifiers_task"])]
        ctx = vf.ModelContext(
            model=MODEL,
            client=vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR),
            sampling=vf.SamplingConfig(max_tokens=self.max_tokens),
        )
        episode = await self.env.run_episode(task, ctx)
        errors = [e.message for e in episode.errors] + [e.message for t in episode.traces for e in t.errors]
        if not episode.ok or not episode.traces:
            raise RuntimeError(f"the verifiers rollout failed: {'; '.join(errors)[:300] or 'no trace'}")
        trace = episode.traces[0]
        if self.traces is not None:
            self.traces[base_url] = trace
        components = {f"reward/{k}": float(v.score) for k, v in trace.rewards.items() if v is not None}
        components.update({f"metric/{k}": float(v) for k, v in trace.metrics.items() if v is not None})
        return {"reward": float(trace.reward), "components": components}
