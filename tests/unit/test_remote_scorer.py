"""The remote scorer against a real local HTTP server (no Ray): batching and concurrency,
retries with back-off, malformed replies counted and retried, null scores dropped and counted,
an outage that waits and recovers or stops with a clear error, auth errors not retried."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from actors.rewards.remote import RemoteScorer, RemoteScorerError, RemoteSettings, parse_reply, _Retryable
from actors.rewards.scorer import RewardError


class Endpoint:
    """A scoring endpoint whose next replies a test scripts: 'ok', 'null', 'garbage', 500, 401, 'down'."""

    def __init__(self) -> None:
        self.script: list = []
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        # rendezvous = N: the first N requests wait (10 s at most) until all N arrived, so a
        # client that sends N at once is seen with N in flight, whatever the scheduling.
        self.rendezvous = 0
        self.arrived = 0
        self.all_arrived = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append({"body": body, "auth": self.headers.get("Authorization")})
                    action = outer.script.pop(0) if outer.script else "ok"
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                    outer.arrived += 1
                    waits = outer.arrived <= outer.rendezvous
                    if outer.arrived == outer.rendezvous:
                        outer.all_arrived.set()
                if waits:
                    outer.all_arrived.wait(timeout=10)
                time.sleep(0.05)
                with outer.lock:
                    outer.in_flight -= 1
                if action == "down":
                    self.connection.close()  # a dropped connection
                    return
                if isinstance(action, int):
                    self.send_response(action)
                    self.end_headers()
                    self.wfile.write(b'{"error": "scripted"}')
                    return
                n = len(body["completions"])
                if action == "garbage":
                    payload = b"<html>not json"
                elif action == "null":
                    payload = json.dumps({"scores": [None] + [float(len(c)) for c in body["completions"][1:]]}).encode()
                elif action == "short":
                    payload = json.dumps({"scores": [1.0] * (n - 1)}).encode()
                else:
                    payload = json.dumps({"scores": [float(len(c)) for c in body["completions"]]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    e = Endpoint()
    yield e
    e.close()


def _scorer(url, **kw):
    settings = dict(
        url=url, batch_size=2, concurrency=2, timeout_s=5, max_retries=2, backoff_s=0.01, max_backoff_s=0.05
    )
    settings.update(kw)
    on_error = settings.pop("on_error", "skip")
    return RemoteScorer(RemoteSettings(**settings), on_error=on_error)


TEXTS = ["a", "bb", "ccc", "dddd", "eeeee"]


def test_batches_in_parallel_with_the_key(endpoint):
    endpoint.rendezvous = 2  # concurrency 2: the first two requests are in flight together
    s = _scorer(endpoint.url, api_key="sekret")
    values, skipped = s.score_texts(["p"] * 5, TEXTS, [{"answer": 1}] * 5)
    assert values == [1.0, 2.0, 3.0, 4.0, 5.0] and skipped == {}
    assert sorted(len(r["body"]["completions"]) for r in endpoint.requests) == [1, 2, 2]
    assert all(r["auth"] == "Bearer sekret" for r in endpoint.requests)
    assert endpoint.max_in_flight == 2
    assert s.last_metrics["remote/requests"] == 3 and s.last_metrics["remote/failed_attempts"] == 0


def test_failures_are_retried_and_counted(endpoint):
    endpoint.script = [500, "garbage", "short"]  # three bad answers to the first request, then fine
    s = _scorer(endpoint.url, batch_size=8, max_retries=3)
    values, _ = s.score_texts(["p"] * 5, TEXTS, [{}] * 5)
    assert values == [1.0, 2.0, 3.0, 4.0, 5.0]
    m = s.last_metrics
    assert m["remote/failed_attempts"] == 3 and m["remote/retries"] == 3 and m["remote/malformed"] == 2
    assert m["remote/requests"] == 4 and m["remote/outages"] == 0


def test_null_scores_drop_their_samples_never_zero(endpoint):
    endpoint.script = ["null"]
    s = _scorer(endpoint.url, batch_size=8)
    values, skipped = s.score_texts(["p"] * 3, TEXTS[:3], [{}] * 3)
    assert values == [None, 2.0, 3.0] and skipped == {"remote_null": 1}
    endpoint.script = ["null"]
    with pytest.raises(RewardError, match="no reward for sample 0"):
        _scorer(endpoint.url, batch_size=8, on_error="raise").score_texts(["p"] * 3, TEXTS[:3], [{}] * 3)


def test_outage_stops_with_a_clear_error(endpoint):
    endpoint.script = ["down"] * 10
    s = _scorer(endpoint.url, batch_size=8, max_retries=1, on_failure="stop")
    with pytest.raises(RemoteScorerError, match="failed 2 times.*on_failure=stop"):
        s.score_texts(["p"], ["x"], [{}])


def test_outage_waits_and_recovers(endpoint):
    endpoint.script = ["down"] * 6  # two retries, then four more failures while waiting
    s = _scorer(endpoint.url, batch_size=8, max_retries=2, on_failure="wait", max_wait_s=30)
    values, _ = s.score_texts(["p"], ["xyz"], [{}])
    assert values == [3.0]
    m = s.last_metrics
    assert m["remote/failed_attempts"] == 6 and m["remote/outages"] == 1 and m["remote/wait_s"] > 0


def test_outage_longer_than_the_wait_stops(endpoint):
    endpoint.script = ["down"] * 1000
    s = _scorer(endpoint.url, batch_size=8, max_retries=0, on_failure="wait", max_wait_s=0.3)
    with pytest.raises(RemoteScorerError, match="still failing after waiting"):
        s.score_texts(["p"], ["x"], [{}])
    assert len(endpoint.requests) < 1000 and endpoint.script  # it gave up while the outage went on


def test_auth_errors_are_not_retried(endpoint):
    endpoint.script = [401]
    s = _scorer(endpoint.url, batch_size=8)
    with pytest.raises(RemoteScorerError, match="HTTP 401"):
        s.score_texts(["p"], ["x"], [{}])
    assert len(endpoint.requests) == 1


def test_reply_parsing():
    assert parse_reply(b'{"scores": [1, null, 2.5]}', 3) == [1.0, None, 2.5]
    for bad in (
        b'{"scores": [1]}',
        b"[1, 2]",
        b'{"scores": ["high", 1]}',
        b'{"scores": [true, 1]}',
        b'{"scores": [NaN, 1]}',
        b"nope",
    ):
        with pytest.raises(_Retryable):
            parse_reply(bad, 2)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="http"):
        RemoteSettings(url="127.0.0.1:8000/v1/score")


def test_not_found_after_answering_is_an_outage(endpoint):
    s = _scorer(endpoint.url, batch_size=8, max_retries=3)
    endpoint.script = [404]
    with pytest.raises(RemoteScorerError, match="HTTP 404"):  # a wrong URL from the start
        s.score_texts(["p"], ["x"], [{}])
    endpoint.script = ["ok", 404, 404]
    assert s.score_texts(["p"], ["x"], [{}])[0] == [1.0]
    assert s.score_texts(["p"], ["xy"], [{}])[0] == [2.0]  # two 404s while it redeploys, then fine
    assert s.last_metrics["remote/failed_attempts"] == 2
