"""Tools an agent calls during a trajectory: parsing calls from the model's text, running them
with limits, and the built-in calculator and sandboxed Python.

A tool call is JSON between tags, the format the Hermes and Qwen chat templates use::

    <tool_call>{"name": "calculator", "arguments": {"expression": "37 * 41"}}</tool_call>

(``ToolCallFormat`` changes the tags). A tool is a Python callable taking keyword arguments and
returning something printable, or a Ray actor handle whose ``call(name, arguments)`` method does
it. Every way a call can go wrong (the JSON does not parse, an unknown tool, wrong arguments, an
exception, a timeout, garbage output) becomes an error text the model reads as the tool's answer
and a counted reason in ``ToolResult.status``; nothing raises out of ``ToolBox.call``.
"""

from __future__ import annotations

import ast
import concurrent.futures
import functools
import json
import operator
import os
import re
import subprocess
import sys
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.agents.sandbox import SandboxLimits

log = logging.getLogger("rayrlhf.tools")


@dataclass(frozen=True)
class ToolCallFormat:
    """Where tool calls sit in the model's text."""

    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"
    # The observation that carries a tool's answer back (a user turn holding these tags).
    response_open: str = "<tool_response>"
    response_close: str = "</tool_response>"

    def find(self, text: str) -> list[str]:
        """The raw payloads between the tags, in order (an unclosed last tag counts too)."""
        pattern = re.escape(self.open_tag) + r"(.*?)(?:" + re.escape(self.close_tag) + r"|$)"
        return [m.group(1).strip() for m in re.finditer(pattern, text, flags=re.DOTALL)]

    def wrap_response(self, text: str) -> str:
        return f"{self.response_open}\n{text}\n{self.response_close}"


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    # Set when the payload was not a well-formed call (the model reads it as the tool's answer).
    error: str = ""


def parse_tool_calls(text: str, fmt: ToolCallFormat = ToolCallFormat()) -> list[ToolCall]:
    """The calls in a reply; a malformed one is a ``ToolCall`` with ``error`` set."""
    calls = []
    for payload in fmt.find(text):
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"malformed tool call (not JSON: {e.msg})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", {}, 'malformed tool call (expected {"name": ..., "arguments": {...}})'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, "malformed tool call (arguments must be an object)"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


@dataclass
class ToolResult:
    text: str
    # 'ok' or the reason it failed: malformed, unknown_tool, bad_arguments, error, timeout.
    status: str = "ok"


@dataclass
class Tool:
    """A callable with the JSON schema the chat template renders for the model."""

    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function description (``apply_chat_template(tools=...)`` takes it)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class ToolBox:
    """Runs tool calls with a per-call timeout and a bound on the answer's length.

    Calls run on a thread pool shared by every trajectory of a rollout; a call that outlives
    ``timeout_s`` is answered with a timeout error at once (a thread cannot be killed: the
    built-in Python tool runs in a subprocess that its own limits end)."""

    def __init__(
        self,
        tools: list[Tool],
        timeout_s: float = 10.0,
        max_output_chars: int = 2000,
        fmt: ToolCallFormat = ToolCallFormat(),
        workers: int = 16,
    ) -> None:
        self.tools = {t.name: t for t in tools}
        self.timeout_s, self.max_output_chars, self.fmt = timeout_s, max_output_chars, fmt
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="rayrlhf-tool")

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def call(self, call: ToolCall) -> ToolResult:
        if call.error:
            return ToolResult(f"error: {call.error}", "malformed")
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"error: unknown tool {call.name!r} (tools: {', '.join(self.tools)})", "unknown_tool")
        future = self._pool.submit(_invoke, tool.fn, call.arguments)
        try:
            value = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            return ToolResult(f"error: {call.name} timed out after {self.timeout_s:g}s", "timeout")
        except TypeError as e:
            return ToolResult(f"error: bad arguments for {call.name}: {e}", "bad_arguments")
        except Exception as e:  # the tool's own failure is the model's to read, not the step's
            return ToolResult(f"error: {call.name} raised {type(e).__name__}: {e}", "error")
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + " ...[truncated]"
        return ToolResult(text)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _invoke(fn: Any, arguments: dict[str, Any]) -> Any:
    """A callable, or a Ray actor handle (``handle.call.remote(arguments)``)."""
    if hasattr(fn, "call") and hasattr(fn.call, "remote"):
        import ray

        return ray.get(fn.call.remote(**arguments))
    return fn(**arguments)


# -- the calculator ------------------------------------------------------------------------------
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Evaluates arithmetic (+ - * / // % ** and parentheses) without ``eval``; the result as
    text (integers without a trailing .0)."""
    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("expression must be a string of at most 200 characters")
    value = _arith(ast.parse(expression.replace("^", "**"), mode="eval").body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def _arith(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_arith(node.operand))
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


CALCULATOR = Tool(
    "calculator",
    calculate,
    "Evaluates an arithmetic expression and returns the result.",
    {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. '(37 + 5) * 41'"}},
        "required": ["expression"],
    },
)


# -- sandboxed Python ----------------------------------------------------------------------------
# Runs before the user's code in the child: the allowed packages on the path, then (a second
# layer behind the operating system's sandbox) no sockets or new processes from Python, then the
# code from stdin.
_PRELUDE = r"""
import sys
sys.path[:0] = [p for p in sys.argv[1:] if p]
def _guard(event, args):
    if event.startswith(("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.fork")):
        raise PermissionError(f"{event} is not allowed in the sandbox")
sys.addaudithook(_guard)
del _guard
_src = sys.stdin.read()
exec(compile(_src, "<tool>", "exec"), {"__name__": "__main__"})
"""

#: How the python tool runs code: in the operating system's sandbox (``actors/agents/sandbox.py``), or
#: in a plain subprocess with rlimits and the audit hook only, which model-written code escapes.
SANDBOX_MODES = ("bwrap", "unsafe")


def run_python(
    code: str, limits: SandboxLimits = SandboxLimits(), mode: str = "bwrap", packages: tuple[str, ...] = ()
) -> str:
    """Runs ``code`` in a fresh interpreter in the sandbox (``actors/agents/sandbox.py``: no network, no
    host files, its processes ended with it, CPU, memory, file, process and output limits);
    returns stdout, or stderr's last line on failure. ``mode="unsafe"`` runs it without the
    sandbox (rlimits and a Python audit hook only)."""
    if not isinstance(code, str):
        raise TypeError("code must be a string")
    if mode == "unsafe":
        return _run_unsafe(code, limits)
    from actors.agents import sandbox

    _, paths = sandbox.bwrap_argv([], limits, sandbox.SandboxSpec(packages=tuple(packages)))
    done = sandbox.run(
        [sandbox.interpreter(), "-I", "-S", "-B", "-c", _PRELUDE, *paths],
        code,
        limits,
        sandbox.SandboxSpec(packages=tuple(packages)),
    )
    return _answer(done.returncode, done.stdout, done.stderr, done.timed_out, limits)


def _answer(returncode: int, stdout: str, stderr: str, timed_out: bool, limits: SandboxLimits) -> str:
    """What the model reads: the output, or the reason the code failed."""
    if timed_out:
        return f"error: the code ran past {limits.wall_s:g}s of wall-clock time and was stopped"
    if returncode != 0:
        last = (stderr.strip().splitlines() or [f"exit status {returncode}"])[-1]
        # SIGKILL / SIGXCPU, as the child's status or as bwrap's 128 + signal: the CPU limit
        if returncode in (-9, -24, 137, 152):
            last = f"the code used more than {limits.cpu_s}s of CPU time"
        return f"error: {last}"[: limits.output_chars]
    return stdout[: limits.output_chars] or "(no output; print the result)"


def _run_unsafe(code: str, limits: SandboxLimits) -> str:
    """The python tool without the sandbox (``env.python_sandbox: unsafe``): a subprocess with
    rlimits, an audit hook and, where ``unshare -rn`` works, no network. ctypes escapes it."""
    cmd = [sys.executable, "-I", "-c", _PRELUDE]
    if _network_namespace_works():
        cmd = ["unshare", "-rn", *cmd]
    try:
        proc = subprocess.run(
            cmd,
            input=code,
            capture_output=True,
            text=True,
            timeout=limits.wall_s,
            preexec_fn=functools.partial(_apply_limits, limits),
            env={"PATH": "/usr/bin:/bin"},
            cwd="/tmp",
        )
    except subprocess.TimeoutExpired:
        return _answer(0, "", "", True, limits)
    return _answer(proc.returncode, proc.stdout, proc.stderr, False, limits)


def _apply_limits(limits: SandboxLimits) -> None:  # runs in the child, before exec
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    mem = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    os.setsid()


@functools.lru_cache(maxsize=1)
def _network_namespace_works() -> bool:
    """Whether ``unshare -rn`` can put the child in an empty network namespace here."""
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_PYTHON_SCHEMA = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "Python source; print the result"}},
    "required": ["code"],
}


def python_tool(mode: str = "bwrap", packages: tuple[str, ...] = (), limits: SandboxLimits = SandboxLimits()) -> Tool:
    """The built-in python tool, fail closed: with ``mode="bwrap"`` a host that cannot build the
    sandbox is a ValueError naming what is missing; ``"unsafe"`` warns (every run that builds it)."""
    from actors.agents import sandbox

    if mode not in SANDBOX_MODES:
        raise ValueError(f"env.python_sandbox must be one of {', '.join(SANDBOX_MODES)}, got {mode!r}")
    if mode == "bwrap":
        try:
            sandbox.check()
        except sandbox.SandboxUnavailable as e:
            raise ValueError(
                f"the python tool runs model-written code in a sandbox, and {e}; "
                "env.python_sandbox=unsafe runs it without one (not recommended)"
            ) from None
    else:
        log.warning(
            "the python tool runs WITHOUT its sandbox (env.python_sandbox=unsafe): model-written code can "
            "read, write and delete this host's files and start processes"
        )
    return Tool(
        "python",
        functools.partial(run_python, limits=limits, mode=mode, packages=tuple(packages)),
        "Runs Python code in a sandbox and returns what it prints.",
        _PYTHON_SCHEMA,
    )


PYTHON = Tool("python", run_python, "Runs Python code in a sandbox and returns what it prints.", _PYTHON_SCHEMA)

BUILTIN_TOOLS = {"calculator": CALCULATOR, "python": PYTHON}


def resolve_tools(
    names: list[str], sandbox: str = "bwrap", packages: tuple[str, ...] = (), sandboxed: tuple[str, ...] = ()
) -> list[Tool]:
    """Built-in tool names, or ``module:attribute`` for a ``Tool``, a callable (its name and
    docstring describe it) or a Ray actor handle's name. The python tool runs in the sandbox
    (``sandbox``: bwrap or unsafe; ``packages`` importable there); a callable marked
    ``@actors.agents.sandbox.sandboxed``, or named in ``sandboxed``, runs there too."""
    import importlib

    from actors.agents import sandbox as sb

    out = []
    for spec in names:
        if spec == "python":
            out.append(python_tool(sandbox, packages))
            continue
        if spec in BUILTIN_TOOLS:
            out.append(BUILTIN_TOOLS[spec])
            continue
        if ":" not in spec:
            raise ValueError(f"tool {spec!r} is neither a built-in ({', '.join(BUILTIN_TOOLS)}) nor 'module:attribute'")
        module, attr = spec.split(":", 1)
        obj = getattr(importlib.import_module(module), attr, None)
        if isinstance(obj, Tool):
            tool = obj
        elif callable(obj):
            tool = Tool(attr, obj, (obj.__doc__ or "").strip().split("\n")[0])
        else:
            raise ValueError(f"tool {spec!r}: {module} has no Tool or callable {attr!r}")
        if spec in sandboxed or sb.is_sandboxed(tool.fn):
            try:
                tool = sb.in_sandbox(tool)
            except sb.SandboxUnavailable as e:
                raise ValueError(f"tool {spec!r} runs in the sandbox, and {e}") from None
        out.append(tool)
    return out
