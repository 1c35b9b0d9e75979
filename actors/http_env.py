"""An environment served over HTTP in the OpenEnv style: ``POST {url}/reset`` and
``POST {url}/step`` with JSON bodies, each answering ``{"observation", "reward", "done"}``.

The action goes out as ``{"action": {action_key: text}}``; a dict observation is read at
``observation_key`` (or, unset, its only or first text field). Every request carries the
episode's ``episode_id`` so one server can hold many episodes at once. A request that fails or
times out raises: the rollout ends that episode and counts it (``env_error`` / ``env_timeout``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from actors.environments import Step


class HttpEnvironment:
    def __init__(self, url: str, action_key: str = "message", observation_key: str = "",
                 timeout_s: float = 30.0, api_key: str = "") -> None:
        import requests

        self.url, self.action_key, self.observation_key, self.timeout_s = url.rstrip("/"), action_key, observation_key, timeout_s
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.episode_id = uuid.uuid4().hex

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = self.session.post(f"{self.url}/{path}", json=body, timeout=self.timeout_s)
        if resp.status_code != 200:
            raise RuntimeError(f"{self.url}/{path} answered HTTP {resp.status_code}: {resp.text[:200]}")
        out = resp.json()
        if not isinstance(out, dict):
            raise RuntimeError(f"{self.url}/{path} answered {type(out).__name__}, expected a JSON object")
        return out

    def reset(self, row: dict[str, Any]) -> Any:
        out = self._post("reset", {"episode_id": self.episode_id, "row": row})
        return self._text(out.get("observation"))

    def step(self, action: str) -> Step:
        out = self._post("step", {"episode_id": self.episode_id, "action": {self.action_key: action}})
        reward = out.get("reward")
        return Step(self._text(out.get("observation")), float(reward) if reward is not None else 0.0,
                    bool(out.get("done")), dict(out.get("metadata") or out.get("info") or {}))

    def _text(self, obs: Any) -> Any:
        if obs is None or isinstance(obs, str):
            return obs
        if isinstance(obs, dict):
            if self.observation_key:
                return str(obs.get(self.observation_key, ""))
            texts = [v for k, v in obs.items() if isinstance(v, str) and k not in ("metadata",)]
            if texts:
                return texts[0]
        return json.dumps(obs)

    def close(self) -> None:
        self.session.close()
