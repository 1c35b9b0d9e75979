"""The Tinker service's state and calls, without HTTP (``app.py`` routes the API to them).

One ``Backend`` pair per base model: a ``LoraTenants`` trainer and an ``AdapterSampler``, each a
Ray actor. Sessions, training clients (models),
sampling sessions and futures live here; adapters and their saved states live in the store:

    <store>/<model_id>/weights/<name>/            save_state: adapter + optimizer/
    <store>/<model_id>/sampler_weights/<name>/    save_weights_for_sampler: adapter (+ optimizer/)

named to clients as ``tinker://<model_id>/<kind>/<name>``. Each folder is a peft adapter folder
(``base_model_name_or_path`` names the base model folder) that transformers and vLLM load.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.tinker.futures import Futures, ModelQueue, UserError

KINDS = ("weights", "sampler_weights")


@dataclass
class TrainerSettings:
    """What ``rayrlhf serve trainer`` serves. ``models``: the base models clients may name, name to
    local model folder."""

    models: dict[str, str] = field(default_factory=dict)
    store: str = ""
    dtype: str = "float32"
    max_adapters: int = 8
    max_rank: int = 64
    max_tokens: int = 512
    max_model_len: int = 1024
    max_pending: int = 256
    max_samples: int = 64
    poll_s: float = 20.0
    kv_cache_gib: float = 1.0


class RoleLost(RuntimeError):
    """The role's process died during a call; a fresh one takes the calls after it."""


class Backend:
    """Calls into a role's Ray actor. With ``make`` (a maker of a fresh actor), a role that dies is replaced for the calls after the one it
    died in, which raises ``RoleLost``."""

    def __init__(self, target: Any, make: Any = None, role: str = "role") -> None:
        self.target, self.make, self.role = target, make, role

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The role's answer; its ``ValueError`` (a refused request) comes back as a ``UserError``
        with the role's own one-line message, not Ray's wrapping of it."""
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return await getattr(self.target, method).remote(*args, **kwargs)
        except RayActorError:
            if self.make is not None:
                self.target = self.make()
            raise RoleLost(f"the {self.role} died during {method}") from None
        except RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else None
            if isinstance(cause, ValueError):
                raise UserError(str(cause)) from None
            raise RuntimeError(f"{method} failed in its role: {type(cause).__name__}: {cause}") from None


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """``tinker://<model_id>/<kind>/<name>`` as (model_id, kind, name)."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise UserError(f"{path!r} is not a tinker:// path")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or not all(parts) or parts[1] not in KINDS or parts[0][0] == "." or parts[2][0] == ".":
        raise UserError(f"{path!r} is not tinker://<model_id>/<weights|sampler_weights>/<name>")
    return parts[0], parts[1], parts[2]


def _check_name(name: str) -> str:
    if not name or "/" in name or name.startswith(".") or len(name) > 200:
        raise UserError(f"checkpoint name {name!r} must be a plain name (no '/')")
    return name


class TinkerService:
    def __init__(self, settings: TrainerSettings, trainers: dict[str, Backend], samplers: dict[str, Backend]) -> None:
        self.settings, self.trainers, self.samplers = settings, trainers, samplers
        self.store = Path(settings.store)
        self.futures = Futures(settings.max_pending)
        self.sessions: dict[str, dict[str, Any]] = {}
        self.models: dict[str, dict[str, Any]] = {}
        self.sampling: dict[str, dict[str, Any]] = {}
        self.lost: dict[str, str] = {}  # model id -> why it is gone

    async def _train(self, base: str, method: str, *args: Any) -> Any:
        """A trainer call; if the trainer died, every client on it is lost (their adapters lived
        there) and the call fails saying so. Saved states are in the store and load as usual."""
        try:
            return await self.trainers[base].call(method, *args)
        except RoleLost as e:
            gone = [mid for mid, m in self.models.items() if m["base"] == base]
            why = f"{e}; the unsaved state of its training clients is lost: load a saved state"
            for mid in gone:
                self.lost[mid] = why
                del self.models[mid]
            raise RoleLost(
                f"the trainer of base model {base!r} died during {method}; {len(gone)} training "
                "client(s) lost their unsaved state: create one from a saved state "
                "(create_training_client_from_state)"
            ) from None

    # ---- sessions -------------------------------------------------------------------------
    def create_session(self, body: dict[str, Any]) -> dict[str, Any]:
        session_id = uuid.uuid4().hex[:16]
        self.sessions[session_id] = {"tags": body.get("tags") or [], "models": []}
        return {"session_id": session_id}

    def _session(self, session_id: Any) -> dict[str, Any]:
        if session_id not in self.sessions:
            raise UserError(f"unknown session_id {session_id!r}")
        return self.sessions[session_id]

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        self._session(body.get("session_id"))
        return {"type": "session_heartbeat"}

    async def finish(self, session_id: str) -> dict[str, Any]:
        """The session's training clients are freed (their saved states stay in the store)."""
        session = self.sessions.pop(session_id, None)
        for model_id in (session or {}).get("models", []):
            m = self.models.pop(model_id, None)
            if m is not None:
                await m["queue"].run(None, lambda mid=model_id, b=m["base"]: self._train(b, "remove", mid))
        return {}

    def capabilities(self) -> dict[str, Any]:
        rows = [
            {
                "model_name": name,
                "max_context_length": self.settings.max_model_len,
                "trainable": True,
                "sampleable": True,
            }
            for name in self.settings.models
        ]
        return {"supported_models": rows}

    # ---- models ---------------------------------------------------------------------------
    def _base(self, name: Any) -> str:
        if name not in self.settings.models:
            raise UserError(f"unknown base_model {name!r}; this service trains {sorted(self.settings.models)}")
        return name

    def _model(self, model_id: Any) -> dict[str, Any]:
        if model_id in self.lost:
            raise UserError(f"model {model_id!r} is gone: {self.lost[model_id]}")
        if model_id not in self.models:
            raise UserError(f"unknown model_id {model_id!r}")
        return self.models[model_id]

    def create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        from actors.lora_tenants import AdapterSpec

        session = self._session(body.get("session_id"))
        base = self._base(body.get("base_model"))
        lora = body.get("lora_config") or {}
        spec = AdapterSpec(
            rank=int(lora.get("rank", 32)),
            seed=lora.get("seed"),
            train_attn=bool(lora.get("train_attn", True)),
            train_mlp=bool(lora.get("train_mlp", True)),
            train_unembed=bool(lora.get("train_unembed", True)),
        )
        model_id = self._new_model_id(body)

        async def create() -> dict[str, Any]:
            await self._train(base, "create", model_id, spec)
            self._register(session, model_id, base, spec.rank)
            return {"model_id": model_id, "type": "create_model"}

        return self._submit(create())

    def _new_model_id(self, body: dict[str, Any]) -> str:
        """The id the SDK derives itself (``service_client.py``): ``<session>:train:<model_seq_id>``."""
        model_id = f"{body['session_id']}:train:{int(body.get('model_seq_id', 0))}"
        if model_id in self.models:
            raise UserError(f"model {model_id!r} exists already")
        return model_id

    def _register(self, session: dict[str, Any], model_id: str, base: str, rank: int) -> None:
        self.models[model_id] = {"base": base, "rank": rank, "queue": ModelQueue()}
        session["models"].append(model_id)

    def get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        model_id = body.get("model_id")
        m = self._model(model_id)
        folder = self.settings.models[m["base"]]
        return {
            "model_id": model_id,
            "model_data": {"arch": _arch(folder), "model_name": m["base"], "tokenizer_id": folder},
            "is_lora": True,
            "lora_rank": m["rank"],
            "model_name": m["base"],
            "type": "get_info",
        }

    def _submit(self, work: Any, **extra: Any) -> dict[str, Any]:
        return {"request_id": self.futures.submit(work), "model_id": extra.get("model_id"), **extra}

    def _in_turn(self, body: dict[str, Any], call: Any) -> dict[str, Any]:
        """``call()`` (a coroutine function) after the model's earlier calls, as a future."""
        m = self._model(body.get("model_id"))
        seq = body.get("seq_id")
        return self._submit(m["queue"].run(int(seq) if seq is not None else None, call), model_id=body["model_id"])

    # ---- training -------------------------------------------------------------------------
    def forward_backward(self, request: Any) -> dict[str, Any]:
        from serving.tinker.wire import forward_backward_output

        m = self._model(request.model_id)

        async def run() -> bytes:
            out = await self._train(
                m["base"],
                "forward_backward",
                request.model_id,
                request.data,
                request.loss_fn,
                request.config,
                request.forward_only,
            )
            return forward_backward_output(out["logprobs"], out["metrics"])

        body = {"model_id": request.model_id, "seq_id": request.seq_id}
        return self._in_turn(body, run)

    def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        from actors.lora_tenants import AdamStep

        m = self._model(body.get("model_id"))
        given = body.get("adam_params") or {}
        known = set(AdamStep.__dataclass_fields__)
        adam = AdamStep(**{k: float(v) for k, v in given.items() if k in known and v is not None})

        async def run() -> dict[str, Any]:
            metrics = await self._train(m["base"], "optim_step", body["model_id"], adam)
            return {"metrics": metrics}

        return self._in_turn(body, run)

    # ---- state ----------------------------------------------------------------------------
    def _folder(self, model_id: str, kind: str, name: str) -> Path:
        return self.store / model_id / kind / _check_name(name)

    def save_weights(self, body: dict[str, Any], kind: str) -> dict[str, Any]:
        m = self._model(body.get("model_id"))
        model_id = body["model_id"]
        name = body.get("path")
        ephemeral = not name
        if ephemeral:  # save_weights_and_get_sampling_client: a sampler of the current weights
            name = f"ephemeral-{body.get('sampling_session_seq_id', 0)}-{uuid.uuid4().hex[:8]}"
        folder = self._folder(model_id, kind, name)
        if folder.exists() and not body.get("overwrite", kind == "sampler_weights"):
            raise UserError(f"tinker://{model_id}/{kind}/{name} exists; pass overwrite to replace it")
        path = f"tinker://{model_id}/{kind}/{name}"

        async def run() -> dict[str, Any]:
            await self._train(m["base"], "save", model_id, str(folder), kind == "weights")
            _write_meta(folder, {"base_model": m["base"], "model_id": model_id, "lora_rank": m["rank"]})
            if kind == "weights" or not ephemeral:
                return {"path": path, "type": "save_weights" if kind == "weights" else "save_weights_for_sampler"}
            sid = self._new_sampler(m["base"], str(folder), path)
            return {"path": None, "sampling_session_id": sid, "type": "save_weights_for_sampler"}

        return self._in_turn(body, run)

    def load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        model_id, kind, name = parse_tinker_path(body.get("path"))
        folder = self._folder(model_id, kind, name)
        meta = _read_meta(folder)
        if meta is None:
            raise UserError(f"no saved state at {body.get('path')}")
        base = self._base(meta["base_model"])
        with_optimizer = bool(body.get("optimizer", False))
        if "model_id" in body and body["model_id"]:  # the legacy load into an existing client
            target = body["model_id"]
            self._model(target)
            return self._in_turn(body, lambda: self._reload(target, base, folder, with_optimizer))
        session = self._session(body.get("session_id"))
        target = self._new_model_id(body)

        async def run() -> dict[str, Any]:
            info = await self._train(base, "load", target, str(folder), with_optimizer)
            self._register(session, target, base, info["lora_rank"])
            return {"path": body["path"], "model_id": target, "type": "load_weights"}

        return self._submit(run(), model_id=target)

    async def _reload(self, model_id: str, base: str, folder: Path, with_optimizer: bool) -> dict[str, Any]:
        await self._train(base, "remove", model_id)
        info = await self._train(base, "load", model_id, str(folder), with_optimizer)
        self.models[model_id]["rank"] = info["lora_rank"]
        return {"model_id": model_id, "type": "load_weights"}

    # ---- sampling -------------------------------------------------------------------------
    def _new_sampler(self, base: str, adapter: str | None, path: str | None) -> str:
        sid = f"sampler-{uuid.uuid4().hex[:16]}"
        self.sampling[sid] = {"base": base, "adapter": adapter, "path": path}
        return sid

    def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        self._session(body.get("session_id"))
        if body.get("model_path"):
            model_id, kind, name = parse_tinker_path(body["model_path"])
            folder = self._folder(model_id, kind, name)
            meta = _read_meta(folder)
            if meta is None:
                raise UserError(f"no saved weights at {body['model_path']}")
            return {"sampling_session_id": self._new_sampler(meta["base_model"], str(folder), body["model_path"])}
        return {"sampling_session_id": self._new_sampler(self._base(body.get("base_model")), None, None)}

    def sampler_info(self, sid: str) -> dict[str, Any]:
        if sid not in self.sampling:
            raise UserError(f"unknown sampling session {sid!r}")
        s = self.sampling[sid]
        return {"sampler_id": sid, "base_model": s["base"], "model_path": s["path"]}

    def asample(self, body: dict[str, Any]) -> dict[str, Any]:
        from actors.rollout.adapter_sampler import SampleParams

        sid = body.get("sampling_session_id")
        if sid not in self.sampling:
            raise UserError(f"unknown sampling_session_id {sid!r}")
        s = self.sampling[sid]
        prompt = _prompt_tokens(body.get("prompt") or {})
        n = int(body.get("num_samples", 1))
        if not 1 <= n <= self.settings.max_samples:
            raise UserError(f"num_samples {n} is outside 1..{self.settings.max_samples}")
        p = body.get("sampling_params") or {}
        known = set(SampleParams.__dataclass_fields__)
        params = SampleParams(**{k: v for k, v in p.items() if k in known and (v is not None or k == "stop")})
        want_prompt = bool(body.get("prompt_logprobs", False))

        async def run() -> bytes:
            from serving.tinker.wire import sample_response

            args = (prompt, n, params, s["adapter"], want_prompt)
            try:
                out = await self.samplers[s["base"]].call("sample", *args)
            except RoleLost:  # a sample changes no state: the fresh engine takes it again
                out = await self.samplers[s["base"]].call("sample", *args)
            return sample_response(out["sequences"], out["prompt_logprobs"])

        prefix = uuid.uuid4().hex[:12]
        return self._submit(run(), sample_sequence_ids=[f"{prefix}-{i}" for i in range(n)])


def _prompt_tokens(prompt: dict[str, Any]) -> list[int]:
    tokens: list[int] = []
    for chunk in prompt.get("chunks") or []:
        if chunk.get("type") != "encoded_text":
            raise UserError(f"only encoded_text prompt chunks are supported (got {chunk.get('type')!r})")
        tokens.extend(int(t) for t in chunk.get("tokens") or [])
    if not tokens:
        raise UserError("the prompt has no tokens")
    return tokens


def _arch(folder: str) -> str:
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError):
        return ""


def _write_meta(folder: Path, meta: dict[str, Any]) -> None:
    (folder / "optimizer").mkdir(parents=True, exist_ok=True)
    (folder / "optimizer" / "tinker.json").write_text(json.dumps(meta, indent=2))


def _read_meta(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "optimizer" / "tinker.json").read_text())
    except (OSError, ValueError):
        return None
