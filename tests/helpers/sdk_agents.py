"""Agent programs on the ecosystem's own clients, unchanged, for the rollout endpoint's tests:
the OpenAI Agents SDK with its default (Responses) model and a function tool, a streaming
``openai`` client, an ``async def`` program, and a LangGraph ReAct agent on ``langchain-openai``.

Each program records what every call returned over the wire (``CALLS[base_url]``: the sampled
token ids and log-probs the endpoint sent), read from the HTTP responses themselves by an
``httpx`` hook, so a test compares the record rows with what the clients were given, not with
what the endpoint says it did. With ``row["meta"]["log"]`` (a folder) the record is also written
there, for programs run inside a Ray generator.

``demonstrations()`` are the calculator conversations exactly as the Agents SDK and LangChain
send them (their tool schemas, the SDK's instructions): a tiny model taught them
(``tests/helpers/tool_agent.py``) really calls the tool through either client.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.helpers.tool_agent import ANSWER, CALL, QUESTION

INSTRUCTIONS = "You are a calculator."
CALLS: dict[str, list[dict]] = {}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    allowed = set("0123456789+-*/(). ")
    return str(eval(expression)) if set(expression) <= allowed else "error"  # noqa: S307 - digits and operators only


def sdk_tool() -> Any:
    from agents import function_tool

    return function_tool(calculator)


def langchain_tool() -> Any:
    from langchain_core.tools import tool

    return tool(calculator)


def demonstrations() -> list[tuple[list[dict], list[dict]]]:
    """(messages, tools) of the calculator conversation as each client renders it to the
    endpoint: the Agents SDK, LangChain, and a verifiers environment's harness (its MCP tool)."""
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from actors.agents.openai_api import _function_tools
    from tests.helpers.vf.toolset import LISTED

    fn = sdk_tool()
    sdk_tools = _function_tools(
        [
            {
                "type": "function",
                "name": fn.name,
                "description": fn.description,
                "parameters": fn.params_json_schema,
                "strict": True,
            }
        ],
        "tools",
        chat_form=False,
    )

    def turns(call: str) -> list[dict]:
        return [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": f"<tool_response>\n{ANSWER}\n</tool_response>"},
            {"role": "assistant", "content": ANSWER},
        ]

    return [
        ([{"role": "system", "content": INSTRUCTIONS}] + turns(CALL), sdk_tools),
        (turns(CALL), [convert_to_openai_tool(langchain_tool())]),
        (turns(CALL.replace('"calculator"', '"calc_calculator"')), [LISTED]),
    ]


# -- what the wire carried ------------------------------------------------------------------------
def _returned(body: bytes, streamed: bool) -> list[dict]:
    """The sampled ids and log-probs of each choice in one HTTP response (JSON or SSE)."""
    if not streamed:
        obj = json.loads(body)
        return [{"token_ids": c["token_ids"], "logprobs": c["token_logprobs"]} for c in obj.get("choices", [obj])]
    out = []
    for line in body.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if obj.get("type") == "response.completed":
            obj = obj["response"]
            out.append({"token_ids": obj["token_ids"], "logprobs": obj["token_logprobs"]})
        for c in obj.get("choices") or []:
            if c.get("token_ids") is not None:
                out.append({"token_ids": c["token_ids"], "logprobs": c["token_logprobs"]})
    return out


def _recorder(base_url: str, row: dict, asynchronous: bool) -> Any:
    def record(response: httpx.Response) -> None:
        if response.status_code == 200:
            streamed = response.headers.get("content-type", "").startswith("text/event-stream")
            calls = CALLS.setdefault(base_url, [])
            calls.append({"path": response.request.url.path, "choices": _returned(response.content, streamed)})
            log = (row.get("meta") or {}).get("log")
            if log:
                Path(log).mkdir(parents=True, exist_ok=True)
                (Path(log) / f"{base_url.rsplit('/', 2)[-2]}.json").write_text(
                    json.dumps({"client": row["meta"].get("client"), "calls": calls})
                )

    async def arecord(response: httpx.Response) -> None:
        await response.aread()
        record(response)

    def srecord(response: httpx.Response) -> None:
        response.read()
        record(response)

    hooks = {"response": [arecord if asynchronous else srecord]}
    return (
        httpx.AsyncClient(event_hooks=hooks, timeout=300)
        if asynchronous
        else httpx.Client(event_hooks=hooks, timeout=300)
    )


def async_client(row: dict, base_url: str) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=_recorder(base_url, row, True))


def sync_client(row: dict, base_url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=_recorder(base_url, row, False))


def _solved(text: Any) -> float:
    return float(str(text or "").strip() == ANSWER)


# -- the programs ---------------------------------------------------------------------------------
async def agents_sdk(row: dict, base_url: str, streamed: bool = False) -> float:
    """The OpenAI Agents SDK as its users write it: an Agent with a function tool on the SDK's
    default model (the Responses API), run by ``Runner.run`` (or ``Runner.run_streamed``)."""
    from agents import Agent, RunConfig, Runner, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider

    set_tracing_disabled(True)
    agent = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[sdk_tool()], model="policy")
    config = RunConfig(model_provider=OpenAIProvider(openai_client=async_client(row, base_url)), tracing_disabled=True)
    if streamed:
        result = Runner.run_streamed(agent, row["prompt"], run_config=config, max_turns=3)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, row["prompt"], run_config=config, max_turns=3)
    return _solved(result.final_output)


async def agents_sdk_streamed(row: dict, base_url: str) -> float:
    return await agents_sdk(row, base_url, streamed=True)


async def streaming_chat(row: dict, base_url: str) -> float:
    """Two chat turns on a streaming ``AsyncOpenAI`` client, the second extending the first."""
    client = async_client(row, base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    for turn in range(2):
        stream = await client.chat.completions.create(
            model="policy", messages=messages, stream=True, max_tokens=12, stream_options={"include_usage": True}
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Turn {turn + 2}."}]
    return _solved(messages[1]["content"])


def langgraph_react(row: dict, base_url: str, streaming: bool = False) -> float:
    """LangGraph's prebuilt ReAct agent on ``ChatOpenAI`` with the calculator tool."""
    import warnings

    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    llm = ChatOpenAI(
        base_url=base_url,
        api_key="unused",
        model="policy",
        max_retries=0,
        streaming=streaming,
        http_client=_recorder(base_url, row, False),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_react_agent's move to langchain.agents
        agent = create_react_agent(llm, [langchain_tool()])
    out = agent.invoke({"messages": [("user", row["prompt"])]}, {"recursion_limit": 8})
    return _solved(out["messages"][-1].content)


def langgraph_react_streaming(row: dict, base_url: str) -> float:
    return langgraph_react(row, base_url, streaming=True)


async def mixed(row: dict, base_url: str) -> float:
    """By ``row["meta"]["client"]``: agents_sdk, agents_sdk_streamed or streaming_chat (one
    ``async def`` program for a run that trains on all three)."""
    program = {"agents_sdk": agents_sdk, "agents_sdk_streamed": agents_sdk_streamed, "streaming_chat": streaming_chat}[
        row["meta"]["client"]
    ]
    return await program(row, base_url)
