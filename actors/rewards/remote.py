"""A remote HTTP scoring endpoint as a scorer (e.g. ``rayrlhf serve scorer``'s ``/v1/score``).

Protocol: ``POST {"prompts": [...], "completions": [...], "meta": [...]}`` with an optional
``Authorization: Bearer <key>``; the reply is ``{"scores": [...]}``, one number or ``null`` (no
reward for that sample) per completion.

Samples go in requests of ``batch_size``, at most ``concurrency`` in flight. A request that fails
(connection refused, timeout, HTTP 5xx or 429, a reply that is not the protocol's) is retried
``max_retries`` times with exponential back-off and jitter. If it still fails the endpoint counts
as down: ``on_failure='stop'`` raises at once; ``'wait'`` keeps retrying every ``max_backoff_s``
until it answers or ``max_wait_s`` has passed, then raises. Other 4xx answers (bad key, wrong
path) are configuration errors and raise at once, except a 404 once the endpoint has answered (a
Serve app being redeployed). Nothing ever becomes a reward that the endpoint
did not give: every failed attempt is counted in ``last_metrics`` (``remote/...``), and a
``null`` score drops its sample (counted as ``remote_null``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from actors.rewards.scorer import RewardError, TextScorer

log = logging.getLogger("rayrlhf.remote_scorer")

_COUNTERS = ("requests", "failed_attempts", "malformed", "retries", "outages", "wait_s")


class RemoteScorerError(RewardError):
    """The endpoint could not score a batch and the config says to stop (or the wait ran out)."""


class _Retryable(Exception):
    """A failure worth retrying: the endpoint may come back."""


@dataclass
class RemoteSettings:
    """What a remote scorer needs; ``cluster.config.RemoteScorerSection`` documents each field."""

    url: str
    api_key: str = ""
    batch_size: int = 32
    concurrency: int = 4
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    on_failure: str = "wait"
    max_wait_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"remote scorer url must start with http:// or https://, got {self.url!r}")
        if self.on_failure not in ("wait", "stop"):
            raise ValueError("remote scorer on_failure must be 'wait' or 'stop'")


def parse_reply(body: bytes, n: int) -> list[float | None]:
    """The scores of a reply for ``n`` samples; raises ``_Retryable`` when it is not the protocol's."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise _Retryable(f"reply is not JSON: {e}") from None
    scores = obj.get("scores") if isinstance(obj, dict) else None
    if not isinstance(scores, list) or len(scores) != n:
        got = f"{len(scores)} scores" if isinstance(scores, list) else "no 'scores' list"
        raise _Retryable(f"reply has {got} for {n} samples")
    out: list[float | None] = []
    for s in scores:
        if s is None:
            out.append(None)
        elif isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s):
            out.append(float(s))
        else:
            raise _Retryable(f"reply holds a score that is not a finite number or null: {s!r}")
    return out


class RemoteScorer(TextScorer):
    def __init__(self, settings: RemoteSettings, on_error: str = "skip") -> None:
        import requests

        self.s = settings
        self.on_error = on_error
        self.session = requests.Session()
        self.session.headers["Content-Type"] = "application/json"
        if settings.api_key:
            self.session.headers["Authorization"] = f"Bearer {settings.api_key}"
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0.0)
        self._answered = False
        self.last_metrics = {}

    def _count(self, key: str, n: float = 1.0) -> None:
        with self._lock:
            self._counts[key] += n

    def _post(self, payload: dict[str, Any], n: int) -> list[float | None]:
        import requests

        self._count("requests")
        try:
            r = self.session.post(self.s.url, data=json.dumps(payload), timeout=self.s.timeout_s)
        except requests.RequestException as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        # 404 after the endpoint has answered: it is being redeployed behind its proxy (an outage);
        # before that the URL is wrong (a configuration error, below).
        if r.status_code >= 500 or r.status_code == 429 or (r.status_code == 404 and self._answered):
            raise _Retryable(f"HTTP {r.status_code}: {r.text[:200]}")
        if r.status_code >= 400:
            raise RemoteScorerError(
                f"remote scorer {self.s.url} refused the request: HTTP {r.status_code}: "
                f"{r.text[:300]} (check reward.remote.url and its API key)"
            )
        try:
            out = parse_reply(r.content, n)
        except _Retryable:
            self._count("malformed")
            raise
        self._answered = True
        return out

    def _delay(self, attempt: int) -> float:
        base = min(self.s.max_backoff_s, self.s.backoff_s * 2**attempt)
        return base * (0.5 + random.random() / 2)  # jitter: concurrent retries do not arrive together

    def _score_batch(self, payload: dict[str, Any]) -> list[float | None]:
        n = len(payload["completions"])
        attempt, outage_start = 0, None
        while True:
            try:
                out = self._post(payload, n)
                if outage_start is not None:
                    log.warning(
                        "remote scorer %s answers again after %.1fs", self.s.url, time.monotonic() - outage_start
                    )
                return out
            except _Retryable as e:
                self._count("failed_attempts")
                error = e
            if attempt < self.s.max_retries:
                delay = self._delay(attempt)
            else:  # retries used up: the endpoint is down
                if self.s.on_failure == "stop":
                    raise RemoteScorerError(
                        f"remote scorer {self.s.url} failed {attempt + 1} times: {error} "
                        "(reward.remote.on_failure=stop)"
                    )
                if outage_start is None:
                    outage_start = time.monotonic()
                    self._count("outages")
                waited = time.monotonic() - outage_start
                if waited >= self.s.max_wait_s:
                    raise RemoteScorerError(
                        f"remote scorer {self.s.url} still failing after waiting {waited:.0f}s "
                        f"(reward.remote.max_wait_s={self.s.max_wait_s:g}): {error}"
                    )
                delay = min(self.s.max_backoff_s, self.s.max_wait_s - waited)
                log.warning(
                    "remote scorer %s down (%s); waiting, %.0fs of at most %.0fs",
                    self.s.url,
                    error,
                    waited,
                    self.s.max_wait_s,
                )
            self._count("retries")
            self._count("wait_s", delay)
            time.sleep(delay)
            attempt += 1

    def score_texts(
        self, prompts: list[str], completions: list[str], meta: list[dict[str, Any]]
    ) -> tuple[list[float | None], dict[str, int]]:
        with self._lock:
            self._counts = dict.fromkeys(_COUNTERS, 0.0)
        b = self.s.batch_size
        payloads = [
            {
                "prompts": prompts[i : i + b],
                "completions": completions[i : i + b],
                "meta": [_jsonable_meta(m) for m in meta[i : i + b]],
            }
            for i in range(0, len(completions), b)
        ]
        with ThreadPoolExecutor(max_workers=min(self.s.concurrency, max(len(payloads), 1))) as pool:
            results = list(pool.map(self._score_batch, payloads))
        values = [v for r in results for v in r]
        self.last_metrics = {f"remote/{k}": v for k, v in self._counts.items()}
        return values, self._drop_or_raise(values, "remote_null", f"remote scorer {self.s.url}")


def _jsonable_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The row's metadata as JSON: values JSON cannot hold become strings."""
    return json.loads(json.dumps(meta, default=str))
