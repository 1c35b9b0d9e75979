"""A client's conversation with tools (OpenAI API: assistant ``tool_calls``, ``tool`` messages)
reaches the chat template as the agent saw such turns in training: the calls as the text the
model writes, the answers of one reply together inside the response tags, the tool list in the
system message only where the template renders none itself."""

import json

import pytest
from transformers import AutoTokenizer

from actors.agents.chat_tokens import ChatTokens, from_client, tool_instructions
from actors.agents.tools import CALCULATOR, ToolCallFormat

TOOLS = [CALCULATOR.schema()]


def _call(expression: str, id_: str) -> dict:
    return {
        "id": id_,
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }


def test_tool_calls_and_answers_become_the_trained_text():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Add "}, {"type": "text", "text": "them."}]},
        {"role": "assistant", "content": None, "tool_calls": [_call("1+2", "a"), _call("3+4", "b")]},
        {"role": "tool", "tool_call_id": "a", "content": "3"},
        {"role": "tool", "tool_call_id": "b", "content": "7"},
        {"role": "assistant", "content": "Both:", "tool_calls": [_call("3+7", "c")]},
        {"role": "tool", "tool_call_id": "c", "content": "10"},
        {"role": "assistant", "content": "10"},
    ]
    got = from_client(messages)
    assert got == [
        {"role": "user", "content": "Add them."},
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>\n'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>',
        },
        {"role": "tool", "content": "<tool_response>\n3\n7\n</tool_response>"},
        {
            "role": "assistant",
            "content": 'Both:\n<tool_call>{"name": "calculator", "arguments": {"expression": "3+7"}}</tool_call>',
        },
        {"role": "tool", "content": "<tool_response>\n10\n</tool_response>"},
        {"role": "assistant", "content": "10"},
    ]
    # Another format's tags; arguments that are not JSON kept as the model wrote them.
    fmt = ToolCallFormat(open_tag="[CALL]", close_tag="[/CALL]", response_open="[OUT]", response_close="[/OUT]")
    odd = [
        {"role": "assistant", "tool_calls": [{"function": {"name": "calculator", "arguments": "{oops"}}]},
        {"role": "tool", "content": "error"},
    ]
    assert from_client(odd, fmt) == [
        {"role": "assistant", "content": '[CALL]{"name": "calculator", "arguments": "{oops"}[/CALL]'},
        {"role": "tool", "content": "[OUT]\nerror\n[/OUT]"},
    ]


def test_a_conversation_without_tools_is_unchanged():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "hello"},
    ]
    assert from_client(messages) == messages


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_the_tool_list_goes_where_training_put_it(tok):
    chat = ChatTokens(tok)  # this template renders no tools
    assert not chat.renders_tools(TOOLS)
    user = [{"role": "user", "content": "q"}]
    assert chat.with_tools(user, TOOLS) == [{"role": "system", "content": tool_instructions(TOOLS)}] + user
    system = [{"role": "system", "content": "Be brief."}] + user
    assert chat.with_tools(system, TOOLS)[0]["content"] == "Be brief.\n\n" + tool_instructions(TOOLS)
    assert chat.with_tools(user, None) == user
    # A template that renders tools itself gets them through its ``tools`` argument only.
    tok2 = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok2.chat_template = (
        "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    own = ChatTokens(tok2)
    assert own.renders_tools(TOOLS) and own.with_tools(user, TOOLS) == user
