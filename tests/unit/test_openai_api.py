"""The OpenAI API as the rollout endpoint reads and writes it (``actors/agents/openai_api.py``), pure:
every reply and every streamed event validates, strictly, against the ``openai`` package's own
models (what its clients parse); Responses input items become the chat conversation they
describe; bad requests name their field."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from actors.agents.openai_api import (
    ApiError,
    Choice,
    chat_reply,
    chat_stream,
    completion_reply,
    completion_stream,
    input_messages,
    parse_chat,
    parse_completion,
    parse_responses,
    reply_message,
    responses_reply,
    responses_stream,
)

MODELS = ("policy",)
CALL_TEXT = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def _choice(text: str, tools=TOOLS) -> Choice:
    message = reply_message(text, tools)
    finish = "tool_calls" if message.get("tool_calls") else "stop"
    return Choice(text, message, [5, 6, 7], [-0.1, -0.2, -0.3], finish, ["a", "b", "c"])


def _events(stream) -> list[dict]:
    out = []
    for event in stream:
        data = [line[6:] for line in event.splitlines() if line.startswith("data: ")]
        out += [json.loads(d) for d in data if d != "[DONE]"]
    return out


def test_chat_replies_and_chunks_validate_and_carry_the_sampled_ids():
    ask = parse_chat(
        {
            "model": "policy",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": TOOLS,
            "n": 2,
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        MODELS,
    )
    choices = [_choice(CALL_TEXT), _choice("plain")]
    reply = ChatCompletion.model_validate(chat_reply(ask, choices, [1, 2]), strict=False)
    assert (
        reply.choices[0].message.tool_calls[0].function.name == "add" and reply.choices[0].finish_reason == "tool_calls"
    )
    assert reply.choices[1].model_extra["token_ids"] == [5, 6, 7] and reply.model_extra["prompt_token_ids"] == [1, 2]
    chunks = [ChatCompletionChunk.model_validate(c) for c in _events(chat_stream(ask, choices, [1, 2]))]
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [f.index for f in finals] == [0, 1] and finals[0].model_extra["token_logprobs"] == [-0.1, -0.2, -0.3]
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


def test_responses_replies_and_event_streams_validate_against_the_openai_types():
    ask = parse_responses(
        {
            "model": "policy",
            "input": "hi",
            "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
        },
        MODELS,
        lambda _: None,
    )
    for text in (CALL_TEXT, "plain"):
        reply = Response.model_validate(responses_reply(ask, _choice(text), [1, 2], "resp_1"))
        assert [o.type for o in reply.output] == (["message", "function_call"] if text == CALL_TEXT else ["message"])
        events = [
            TypeAdapter(ResponseStreamEvent).validate_python(e)
            for e in _events(responses_stream(ask, _choice(text), [1], "r"))
        ]
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].response.output[-1].type == ("function_call" if text == CALL_TEXT else "message")


def test_completions_validate_by_text_and_by_ids():
    for prompt in ("Once", [3, 4, 5], ["Once"]):
        ask = parse_completion({"model": "policy", "prompt": prompt, "logprobs": 1, "stream": True}, MODELS)
        choice = Choice("upon", {}, [9], [-0.5], "length", ["upon"])
        reply = Completion.model_validate(completion_reply(ask, [choice], [1]))
        assert reply.choices[0].logprobs.token_logprobs == [-0.5]
        events = _events(completion_stream(ask, [choice], [1]))
        assert "".join(Completion.model_validate(e).choices[0].text for e in events) == "upon"


def test_responses_input_items_are_the_conversation_they_describe():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "What is 2+3?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Let me add.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 1, "b": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"type": "function_call_output", "call_id": "c2", "output": "2"},
    ]
    assert input_messages(items) == [
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
                {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
    ]
    earlier = {
        "resp_a": [
            {"role": "system", "content": "old"},
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y"},
        ]
    }
    ask = parse_responses(
        {"model": "policy", "instructions": "Be brief.", "previous_response_id": "resp_a", "input": "z"},
        MODELS,
        earlier.get,
    )
    assert ask.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"},
        {"role": "user", "content": "z"},
    ]


@pytest.mark.parametrize(
    "parse, body, param",
    [
        (parse_chat, {"model": "policy", "messages": []}, "messages"),
        (parse_chat, {"model": "other", "messages": [{"role": "user", "content": "x"}]}, "model"),
        (
            parse_chat,
            {"model": "policy", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            "tool_choice",
        ),
        (
            parse_chat,
            {
                "model": "policy",
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        (parse_completion, {"model": "policy", "prompt": ""}, "prompt"),
        (parse_completion, {"model": "policy", "prompt": "x", "n": 99}, "n"),
    ],
)
def test_a_request_the_endpoint_cannot_honour_names_its_field(parse, body, param):
    with pytest.raises(ApiError) as e:
        parse(body, MODELS)
    assert e.value.param == param and e.value.body()["error"]["param"] == param
    assert parse_chat({"model": "anything", "messages": [{"role": "user", "content": "x"}]}, ("*",)).model == "anything"
