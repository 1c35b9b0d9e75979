"""Tool calls: parsed from the model's text, run with limits; every failure is the model's to
read (an error text and a counted status), never an exception out of the toolbox. The Python
tool runs in a subprocess with CPU-time, memory and wall-clock limits, without network or child
processes."""

import json
import threading

import pytest

from actors.agents.tools import (
    CALCULATOR,
    PYTHON,
    SandboxLimits,
    Tool,
    ToolBox,
    ToolCall,
    ToolCallFormat,
    calculate,
    parse_tool_calls,
    resolve_tools,
    run_python,
)


def test_calls_are_parsed_between_tags_and_malformed_ones_are_marked():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "37 * 41"}}</tool_call>'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
        '<tool_call>{"name": "calculator", "arguments": 5}</tool_call><tool_call>{"name": "x"'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [
        ("calculator", {"expression": "37 * 41"}),
        ("python", {"code": "print(1)"}),
    ]
    assert [bool(c.error) for c in calls] == [False, False, True, True, True, True]
    assert parse_tool_calls("no calls here") == []
    fmt = ToolCallFormat("[CALL]", "[/CALL]")
    assert parse_tool_calls('[CALL]{"name": "a", "arguments": {}}[/CALL]', fmt)[0].name == "a"


def test_the_calculator_does_arithmetic_and_nothing_else():
    assert calculate("37 * 41") == "1517" and calculate("(2 + 3) ** 2 / 5") == "5" and calculate("7 / 2") == "3.5"
    assert calculate("-3 + 2^3") == "5"
    for bad in ("__import__('os').system('ls')", "a + 1", "9 ** 9 ** 9", "[1, 2]", "1" * 300):
        with pytest.raises((ValueError, SyntaxError)):
            calculate(bad)


def test_every_failure_becomes_an_error_observation_with_a_counted_status():
    """The deliberate timeout applies to the hung tool's box alone (the other calls run under the
    default limit, so a slow host cannot time them out), and the hung tool is still held, by an
    event this test sets only afterwards, when its call has returned."""
    release, entered = threading.Event(), threading.Event()

    def hangs() -> str:
        entered.set()
        release.wait()
        return "late"

    def broken() -> str:
        raise KeyError("boom")

    box = ToolBox([CALCULATOR, Tool("broken", broken), Tool("big", lambda: "x" * 10_000)], max_output_chars=100)
    hung_box = ToolBox([Tool("hangs", hangs)], timeout_s=0.3)
    cases = {
        "ok": ToolCall("calculator", {"expression": "6 * 7"}),
        "error": ToolCall("broken", {}),
        "bad_arguments": ToolCall("calculator", {"expr": "1"}),
        "unknown_tool": ToolCall("nope", {}),
        "malformed": ToolCall("", {}, "malformed tool call (not JSON)"),
    }
    try:
        results = {status: box.call(call) for status, call in cases.items()}
        results["timeout"] = hung_box.call(ToolCall("hangs", {}))
        assert entered.is_set() and not release.is_set()  # answered while the tool still hangs
    finally:
        release.set()
    assert {k: r.status for k, r in results.items()} == {k: k for k in [*cases, "timeout"]}
    assert results["ok"].text == "42"
    assert all(r.text.startswith("error:") for k, r in results.items() if k != "ok")
    big = box.call(ToolCall("big", {}))
    assert big.status == "ok" and len(big.text) < 130 and big.text.endswith("[truncated]")
    box.close()
    hung_box.close()


def test_python_runs_sandboxed_with_limits():
    assert run_python("print(sum(range(10)))").strip() == "45"
    assert run_python("x = 1") == "(no output; print the result)"
    assert "ZeroDivisionError" in run_python("1 / 0")
    assert "not allowed" in run_python("import socket; socket.create_connection(('127.0.0.1', 80))")
    assert "not allowed" in run_python("import subprocess; subprocess.run(['true'])")
    assert "not allowed" in run_python("import os; os.system('true')")
    assert "CPU time" in run_python("while True: pass", SandboxLimits(cpu_s=1, wall_s=20))
    assert "MemoryError" in run_python("x = bytearray(2 * 10**9)", SandboxLimits(memory_mb=256))
    assert "wall-clock" in run_python("import time; time.sleep(5)", SandboxLimits(wall_s=0.5))
    assert PYTHON.schema()["function"]["parameters"]["required"] == ["code"]


def test_tools_resolve_by_name_or_module_path():
    assert [t.name for t in resolve_tools(["calculator", "python"])] == ["calculator", "python"]
    assert resolve_tools(["actors.agents.tools:calculate"])[0].name == "calculate"
    for bad in ("nope", "actors.agents.tools:missing"):
        with pytest.raises(ValueError):
            resolve_tools([bad])


def test_the_policy_servers_hermes_parser_reads_the_format_agents_train_with(tiny_model_path):
    """``rayrlhf serve policy`` answers chat requests with ``tools`` through vLLM's ``hermes`` tool
    parser: it reads the calls an agent trained here writes, as ``parse_tool_calls`` does."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    text = (
        'Let me use the calculator. <tool_call>{"name": "calculator", "arguments": {"expression": "37 * 41"}}'
        '</tool_call>\n<tool_call>{"name": "python", "arguments": {"code": "print(2 ** 10)"}}</tool_call>'
    )
    parser = Hermes2ProToolParser(AutoTokenizer.from_pretrained(tiny_model_path))
    request = ChatCompletionRequest(
        model="policy", messages=[{"role": "user", "content": "x"}], tools=[CALCULATOR.schema(), PYTHON.schema()]
    )
    served = parser.extract_tool_calls(text, request)
    assert served.tools_called and served.content.strip() == "Let me use the calculator."
    ours = parse_tool_calls(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in served.tool_calls] == [
        (c.name, c.arguments) for c in ours
    ]
