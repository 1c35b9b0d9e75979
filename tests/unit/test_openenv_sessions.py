"""OpenEnv through its real protocol (``actors/agents/openenv.py``), against a server built with
``openenv-core``'s own ``create_app`` in a process of its own: an episode is one WebSocket
session, so its later turns see its earlier ones (the server's HTTP routes build a fresh
environment per request, shown first); a server at capacity is waited for; a killed server
ends the episode with an error at once; the action is built from the server's schema; and an
OpenEnv ``Environment`` class in-process answers as its server does."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest
import requests

from actors.agents.environments import EnvSpec, Step, environment_factory
from actors.agents.openenv import OpenEnvError, OpenEnvOptions, OpenEnvServer
from serving.common import free_port
from tests.helpers.openenv_envs import start_server

OPTS = {"reset_fields": ["prompt", "answer"], "connect_wait_s": 120}


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = start_server(port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def _play(make, i: int, replies=("7 7 7", "x", "y")) -> list:
    env = make()
    out = [env.reset({"prompt": f"Question {i}.", "answer": str(i)})]
    try:
        for reply in replies:
            out.append(env.step(reply))
            if out[-1].done:
                break
    finally:
        env.close()
    return out


def test_the_servers_http_routes_are_stateless_and_a_session_is_not(server):
    url = server
    assert requests.post(f"{url}/reset", json={"prompt": "Question."}, timeout=30).json()["done"] is False
    # A step after a reset over HTTP runs on a fresh environment: it ends at once, reward 0.
    assert requests.post(f"{url}/step", json={"action": {"message": "7"}}, timeout=30).json() == {
        "observation": {"prompt": ""},
        "reward": 0.0,
        "done": True,
    }
    make = environment_factory(EnvSpec(url, openenv=OPTS))
    # Over the session: three turns, the reward of the first reply given after the third.
    assert _play(make, 0, ("12 3a", "no digits", "none")) == [
        "Question 0.",
        Step("Turn 2.", 0.0, False, {}),
        Step("Turn 3.", 0.0, False, {}),
        Step(None, 3 / 4, True, {}),
    ]


def test_more_episodes_than_the_server_holds_wait_for_a_session_and_all_finish(tmp_path):
    """A 4-session server whose first 4 resets wait until 4 sessions are open at once."""
    port, prefix = free_port(), tmp_path / "gather"
    proc = start_server(port, max_sessions=4, env={"OPENENV_TEST_GATHER": f"4:{prefix}"})
    try:
        episodes = _twelve_episodes(f"http://127.0.0.1:{port}")
    finally:
        proc.kill()
        proc.wait()
    assert [ep[0] for ep in episodes] == [f"Question {i}." for i in range(12)]
    assert all(ep[-1] == Step(None, 1.0, True, {}) and len(ep) == 4 for ep in episodes)
    # The first four met at their reset: four sessions were open at once, never more.
    assert Path(f"{prefix}.gathered").read_text() == "4"


def _twelve_episodes(url: str) -> list:
    make = environment_factory(EnvSpec(url, openenv=OPTS))
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        return list(pool.map(lambda i: _play(make, i), range(12)))


def test_the_action_comes_from_the_schema_and_a_bad_mapping_is_one_line(server):
    url = server
    assert OpenEnvServer(url, OpenEnvOptions()).action_field == "message"
    with pytest.raises(ValueError, match=r"action_field 'code' is not a field of the action \(metadata, message\)"):
        OpenEnvServer(url, OpenEnvOptions(action_field="code"))
    with pytest.raises(ValueError, match=r"/schema: .*OpenEnv server"):
        OpenEnvServer(f"http://127.0.0.1:{free_port()}", OpenEnvOptions(timeout_s=5))
    with pytest.raises(OpenEnvError, match=r"reset_fields \['level'\] are not in the row"):
        environment_factory(EnvSpec(url, openenv={"reset_fields": ["level"]}))().reset({"prompt": "x"})
    with pytest.raises(OpenEnvError, match="step before reset"):
        environment_factory(EnvSpec(url, openenv=OPTS))().step("7")


def test_a_server_killed_mid_episode_ends_it_with_an_error(tmp_path):
    port = free_port()
    hold = tmp_path / "hold"
    proc = start_server(port, env={"OPENENV_TEST_HOLD": f"{hold}:1:1"})  # the first episode waits
    try:
        env = environment_factory(EnvSpec(f"http://127.0.0.1:{port}", openenv=OPTS, step_timeout_s=600))()
        assert env.reset({"prompt": "Q.", "answer": "0"}) == "Q."
        assert env.step("1") == Step("Turn 2.", 0.0, False, {})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = pool.submit(env.step, "2")  # held by the server until it dies
            while not Path(f"{hold}.held").exists():
                assert not second.done(), second.result()
                time.sleep(0.01)
            proc.kill()
            with pytest.raises(OpenEnvError, match="the session was closed"):
                second.result()
        env.close()
    finally:
        proc.kill()
        proc.wait()


def test_an_openenv_class_in_process_answers_as_its_server_does(server):
    url = server
    remote = environment_factory(EnvSpec(url, openenv=OPTS))
    local = environment_factory(EnvSpec("tests.helpers.openenv_envs:ThreeTurns", openenv=OPTS))
    for replies in [("1 2", "a", "b"), ("none", "9", "9")]:
        assert _play(local, 3, replies) == _play(remote, 3, replies)
    with pytest.raises(ValueError, match="action_defaults"):
        environment_factory(EnvSpec("tests.helpers.openenv_envs:ThreeTurns", openenv={"action_field": "metadata"}))
