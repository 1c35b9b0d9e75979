"""Training on an OpenEnv environment served by ``openenv-core``'s own ``create_app`` (a server
process of its own), through ``env.name: http://127.0.0.1:<port>`` on the real stack: every
episode is one WebSocket session and reaches its third turn, 32 sessions are open at once, the
rewards equal those of the same environment class run in-process, and a server killed while it
holds half of a step's episodes costs exactly those episodes (counted as env_error) while the
run goes on against the restarted server."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from cluster.config.loading import load_config
from cluster.driver import train
from serving.common import free_port
from tests.helpers.openenv_envs import start_server
from tests.helpers.runs import rows

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
PROMPTS, SAMPLES = 4, 8
EPISODES = PROMPTS * SAMPLES
COMMON = [
    "env.max_turns=3",
    f"env.workers={EPISODES}",
    "env.openenv.reset_fields=prompt,answer",
    "run.plot=false",
    "run.save_final=false",
    "run.eval_every=0",
    "ppo.advantage_estimator=grpo",
    f"rollout.samples_per_prompt={SAMPLES}",
    f"rollout.prompts_per_step={PROMPTS}",
    "env.openenv.connect_wait_s=600",
]


def _config(name: str, steps: int):
    return load_config(ROOT / "configs" / "ppo_tiny.yaml", [*COMMON, f"env.name={name}", f"run.steps={steps}"])


def _kill_and_restart(state: dict, port: int, hold: Path, done: threading.Event) -> None:
    """Once the server holds step 4's odd-numbered episodes and the others have ended: kill it,
    then start a plain one on the same port (the run's next resets wait for it)."""
    while not Path(f"{hold}.held").exists() and not done.is_set():
        done.wait(0.05)
    if done.is_set():
        return
    state["server"].kill()
    state["server"].wait()
    state["killed"] = True
    state["server"] = start_server(port)


def test_an_openenv_server_trains_like_the_environment_in_process_and_survives_its_death(ray_cluster, tmp_path):
    port, gather, hold = free_port(), tmp_path / "gather", tmp_path / "hold"
    # The first step's 32 resets wait until 32 sessions are open; step 4's resets (97-128) are held.
    state = {
        "server": start_server(
            port,
            max_sessions=EPISODES,
            env={
                "OPENENV_TEST_GATHER": f"{EPISODES}:{gather}",
                "OPENENV_TEST_HOLD": f"{hold}:{3 * EPISODES + 1}:{EPISODES}",
            },
        )
    }
    done = threading.Event()
    killer = threading.Thread(target=_kill_and_restart, args=(state, port, hold, done), daemon=True)
    killer.start()
    try:
        train(_config(f"http://127.0.0.1:{port}", 5), run_dir=tmp_path / "served")
    finally:
        done.set()
        killer.join()
        state["server"].kill()
        state["server"].wait()
    train(_config("tests.helpers.openenv_envs:ThreeTurns", 3), run_dir=tmp_path / "local")

    served, local = rows(tmp_path / "served"), rows(tmp_path / "local")
    assert state.get("killed") and Path(f"{gather}.gathered").read_text() == str(EPISODES)
    assert [r["step"] for r in served] == [1, 2, 3, 4, 5]
    for r in served[:3] + served[4:]:  # every episode reached its third turn and ended there
        assert r["episode/turns_mean"] == 3.0 and r["episode/status_done"] == EPISODES, r
    # Step 4: the 16 episodes the server held when it died are counted; the 16 others trained.
    assert served[3]["episode/status_env_error"] == EPISODES // 2 and served[3]["episode/status_done"] == EPISODES // 2
    assert served[3]["reward/n"] == EPISODES // 2
    # Up to the kill the served environment and the class in-process gave the same rewards.
    for key in ("reward/mean", "reward/std"):
        assert [r[key] for r in served[:3]] == pytest.approx([r[key] for r in local], abs=1e-6), key
    assert max(r["logprob_gap/max_abs"] for r in served) < 1e-3
