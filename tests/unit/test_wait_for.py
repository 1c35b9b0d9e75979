"""The suite's waits: ``wait_for`` returns the event's value, and a wait that gives up says for how
long it waited, under which scale, and what the system under test was doing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.helpers.timeouts import SCALE, scaled

ROOT = Path(__file__).resolve().parents[2]


def test_a_wait_returns_the_events_value():
    seen = iter([None, 0, "ready"])
    assert wait_for(lambda: next(seen), timeout=5, interval=0) == "ready"


def test_a_wait_that_gives_up_reports_its_scaled_limit_and_the_runs_state():
    with pytest.raises(TimeoutError) as err:
        wait_for(lambda: False, timeout=0.01 / SCALE, interval=0, describe=lambda: "3 steps logged; last: step 3/8")
    assert f"RAYRLHF_TEST_TIMEOUT_SCALE={SCALE:g}" in str(err.value)
    assert str(err.value).endswith("3 steps logged; last: step 3/8")
    assert scaled(2.0) == 2.0 * SCALE


@pytest.mark.parametrize("value, ok", [("0.5", True), ("abc", False), ("0", False), ("-1", False)])
def test_the_scale_is_read_from_the_environment_and_a_bad_one_is_refused_in_a_line(value, ok):
    env = {**os.environ, "RAYRLHF_TEST_TIMEOUT_SCALE": value}
    code = "from tests.helpers.timeouts import scaled; print(scaled(10))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    if ok:
        assert out.returncode == 0 and out.stdout.strip() == "5.0", out.stderr
    else:
        assert out.returncode == 1 and "RAYRLHF_TEST_TIMEOUT_SCALE must be a positive number" in out.stderr


def test_a_hold_is_signalled_and_lasts_until_released(tmp_path):
    import threading

    from tests.helpers.timeouts import hold

    prefix = str(tmp_path / "h")
    done = threading.Event()
    holder = threading.Thread(target=lambda: (hold(prefix, 600), done.set()), daemon=True)
    holder.start()
    wait_for(lambda: (tmp_path / "h.held").exists(), timeout=60, interval=0.01)
    assert not done.is_set()  # held: nothing released it yet
    (tmp_path / "h.release").touch()
    holder.join(scaled(60))
    assert done.is_set()
    (tmp_path / "h.held").unlink()
    hold(prefix, 600)  # once released it never holds again
    assert not (tmp_path / "h.held").exists()
