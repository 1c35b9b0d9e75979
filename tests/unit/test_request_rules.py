"""The policy server's request rules as the engine receives them: ``Guard`` (API key, body size)
and ``RequestRules`` (limits, chat's default ``max_tokens``, tool conversations as trained) in
front of an ASGI app that records the body it was handed. The rules are ``PolicyServer``'s own
(the class, without its engine); no Ray, no vLLM engine."""

import asyncio
import json

import httpx
import pytest

from serving.common import Limits, configure_guard

KEY = "k-123"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


@pytest.fixture()
def stack(tiny_model_path):
    from serving.policy import GUARD, PolicyServer, RequestRules
    from serving.common import Guard

    class Rules:  # PolicyServer's rules without the engine it would start
        apply_rules, _as_trained, _chat_tokens = (
            PolicyServer.apply_rules,
            PolicyServer._as_trained,
            PolicyServer._chat_tokens,
        )

    server = Rules()
    server.limits, server.model_path, server._chat = (
        Limits(max_n=4, max_tokens=32, max_body_bytes=4096),
        tiny_model_path,
        None,
    )
    configure_guard(GUARD, KEY, server.limits.max_body_bytes)
    seen: list[dict] = []

    async def engine(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = dict(scope["headers"])
        seen.append({"path": scope["path"], "body": body, "length": int(headers[b"content-length"])})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})

    return Guard(RequestRules(engine, server=server), settings=GUARD), seen, server


def post(app, path: str, body, key: str | None = KEY) -> httpx.Response:
    async def go():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path, content=content, headers=headers)

    return asyncio.run(go())


CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_without_max_tokens_gets_the_limit_and_the_length_header_follows_the_body(stack):
    app, seen, _ = stack
    assert post(app, "/v1/chat/completions", CHAT).status_code == 200
    sent = json.loads(seen[0]["body"])
    assert sent["max_tokens"] == 32 and sent["messages"] == CHAT["messages"]
    assert seen[0]["length"] == len(seen[0]["body"])


def test_bodies_the_rules_do_not_change_reach_the_engine_byte_for_byte(stack):
    app, seen, _ = stack
    raw = b'{"model":"policy","prompt":"The answer is",  "max_tokens":8}'
    for path, body in (
        ("/v1/completions", raw),
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/models", b""),
    ):
        assert post(app, path, body).status_code == 200
    assert [s["body"] for s in seen] == [raw, b"{not json", b"[1, 2]", b""]


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("n", 5, "n must be between 1 and 4"),
        ("max_tokens", -1, "max_tokens must be"),
        ("max_tokens", 10**9, "max_tokens must be"),
        ("max_completion_tokens", 33, "max_tokens must be"),
    ],
)
def test_requests_over_the_limits_are_refused_before_the_engine(stack, field, value, needle):
    app, seen, _ = stack
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = post(app, path, {**CHAT, "prompt": "x", field: value})
        assert r.status_code == 400 and needle in r.json()["error"]["message"]
    assert seen == []


def test_key_and_size_are_checked_before_the_rules(stack):
    app, seen, _ = stack
    assert post(app, "/v1/chat/completions", CHAT, key=None).status_code == 401
    assert post(app, "/v1/chat/completions", CHAT, key="nope").status_code == 401
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert post(app, "/v1/chat/completions", big).status_code == 413
    assert seen == []


def test_a_tool_conversation_reaches_the_engine_as_the_agents_saw_it_in_training(stack):
    from actors.agents.chat_tokens import from_client

    app, seen, server = stack
    messages = [
        {"role": "user", "content": "What is 37 * 41?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": json.dumps({"expression": "37 * 41"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1517"},
    ]
    assert (
        post(app, "/v1/chat/completions", {**CHAT, "messages": messages, "tools": TOOLS, "max_tokens": 8}).status_code
        == 200
    )
    sent = json.loads(seen[0]["body"])
    expected = server._chat_tokens().with_tools(from_client(messages), TOOLS)
    assert sent["messages"] == expected and sent["tools"] == TOOLS and sent["max_tokens"] == 8
    assert not any("tool_calls" in m for m in sent["messages"])  # the calls are text the model wrote
    assert any("calculator" in str(m.get("content")) and m["role"] == "assistant" for m in sent["messages"])
