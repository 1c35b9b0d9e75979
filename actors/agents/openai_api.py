"""The OpenAI API as the rollout endpoint speaks it: requests in, replies out, no server here.

Three routes ask the policy for the same thing, a reply to a context: chat completions
(``messages``), the Responses API (``input`` items, ``instructions``, function tools,
``previous_response_id``) and completions (a text or token-id ``prompt``). Each request is read
into one ``Ask`` (what to sample from, how many, how long); each sampled reply into a ``Choice``
(its text, its assistant message with parsed tool calls, its token ids and log-probs); and the
choices are written back in the route's own shape, as one JSON body or as the Server-Sent Events
the ``openai`` client parses (``stream=true``). Every reply carries the sampled token ids
(``token_ids``, beside the prompt's ``prompt_token_ids``), in the final chunk of a stream.

A stream is written once the reply is sampled (its text in one delta): rollouts are scored by
the whole episode, and the engine's batch, not a client's first token, sets their pace.

Refused with an OpenAI-shaped 400 naming the field (``ApiError``): a malformed body, a model
the endpoint does not serve, a tool choice it cannot force (``required`` or a named function:
the engine samples freely), a structured output format, ``top_logprobs`` (the engine records
the sampled token's log-prob only), and non-function tools. Sampling settings in a request
(``temperature``, ``top_p``, ``seed``...) are ignored: the run's rollout settings apply, so the
samples stay on-policy.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from actors.agents.tools import parse_tool_calls


class ApiError(ValueError):
    """A request the endpoint cannot honour: answered ``status`` with OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": str(self), "type": "invalid_request_error", "param": self.param, "code": self.code}
        }


@dataclass
class Ask:
    """What one request asks of the policy, whatever its route."""

    route: str  # chat | responses | completions
    model: str
    messages: list[dict] | None = None  # chat and responses: the conversation
    tools: list[dict] | None = None  # in chat-completions form
    prompt: str | list[int] | None = None  # completions
    n: int = 1
    max_tokens: int | None = None
    stop: list[str] | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    tool_choice: str = "auto"  # auto | none
    # Responses API: the request's own fields echoed in its reply, and what it continues.
    instructions: str | None = None
    previous_response_id: str | None = None
    echo: dict[str, Any] = field(default_factory=dict)


@dataclass
class Choice:
    """One sampled reply."""

    text: str
    message: dict[str, Any]  # the assistant message (content, tool_calls)
    token_ids: list[int]
    logprobs: list[float]
    finish: str  # stop | length | tool_calls
    tokens: list[str] = field(default_factory=list)  # each sampled token's text


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None


class _ChatBody(_Body):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None


class _CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    suffix: str | None = None


class _ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None


def _validated(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        raise ApiError(f"{param}: {err['msg']}", param=param) from None


def _check_model(model: str, models: tuple[str, ...]) -> None:
    if "*" not in models and model not in models:
        raise ApiError(
            f"the model {model!r} is not served here (served: {', '.join(models)}; rollout.agent_models adds names)",
            param="model",
            code="model_not_found",
        )


def _tool_choice(choice: Any, param: str = "tool_choice") -> str:
    if choice in (None, "auto"):
        return "auto"
    if choice == "none":
        return "none"
    raise ApiError(
        f"{param} {choice!r} cannot be honoured: the policy samples freely (use 'auto' or 'none')", param=param
    )


def _common(body: _Body) -> dict[str, Any]:
    if body.top_logprobs:
        raise ApiError(
            "top_logprobs is not served: the endpoint records the sampled token's log-prob only", param="top_logprobs"
        )
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    return {
        "model": body.model,
        "n": body.n,
        "stream": body.stream,
        "stop": stop or None,
        "include_usage": bool((body.stream_options or {}).get("include_usage")),
        "logprobs": bool(body.logprobs),
    }


def parse_chat(raw: Any, models: tuple[str, ...]) -> Ask:
    body = _validated(_ChatBody, raw)
    _check_model(body.model, models)
    for i, m in enumerate(body.messages):
        if not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}].role is missing", param=f"messages[{i}].role")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise ApiError(
            "response_format other than text is not served (no constrained decoding)", param="response_format"
        )
    tools = _function_tools(body.tools, "tools", chat_form=True)
    return Ask(
        "chat",
        messages=body.messages,
        tools=tools,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        tool_choice=_tool_choice(body.tool_choice),
        **_common(body),
    )


def parse_completion(raw: Any, models: tuple[str, ...]) -> Ask:
    body = _validated(_CompletionBody, raw)
    _check_model(body.model, models)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError("one prompt per request (each is its own trajectory)", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise ApiError("prompt is empty", param="prompt")
    if body.echo or body.suffix:
        raise ApiError("echo and suffix are not served", param="echo" if body.echo else "suffix")
    return Ask("completions", prompt=prompt, max_tokens=body.max_tokens, **_common(body))


def _function_tools(tools: list[dict] | None, param: str, chat_form: bool) -> list[dict] | None:
    """Function tools in chat-completions form; other tool types refused."""
    out = []
    for i, t in enumerate(tools or []):
        if t.get("type") != "function":
            raise ApiError(
                f"{param}[{i}]: only function tools are served, not {t.get('type')!r}", param=f"{param}[{i}].type"
            )
        fn = t.get("function") if chat_form else {k: t[k] for k in ("name", "description", "parameters") if k in t}
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(f"{param}[{i}] has no function name", param=f"{param}[{i}]")
        out.append({"type": "function", "function": fn})
    return out or None


# -- the Responses API's input as a conversation -------------------------------------------------
def parse_responses(raw: Any, models: tuple[str, ...], earlier: Callable[[str], list[dict] | None]) -> Ask:
    """``earlier(response_id)``: the conversation that response ended (its input and output),
    or None for an id this episode never answered."""
    body = _validated(_ResponsesBody, raw)
    _check_model(body.model, models)
    if body.top_logprobs:
        raise ApiError("top_logprobs is not served", param="top_logprobs")
    fmt = (body.text or {}).get("format") or {}
    if fmt.get("type") not in (None, "text"):
        raise ApiError("text.format other than text is not served (no constrained decoding)", param="text.format")
    history: list[dict] = []
    if body.previous_response_id:
        found = earlier(body.previous_response_id)
        if found is None:
            raise ApiError(
                f"no response {body.previous_response_id!r} in this episode",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = [m for m in found if m.get("role") != "system"]
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    messages += input_messages(body.input)
    if not messages:
        raise ApiError("input is empty", param="input")
    echo = {
        "instructions": body.instructions,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
    }
    return Ask(
        "responses",
        model=body.model,
        messages=messages,
        tools=_function_tools(body.tools, "tools", chat_form=False),
        max_tokens=body.max_output_tokens,
        stream=body.stream,
        tool_choice=_tool_choice(body.tool_choice),
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        echo=echo,
    )


def input_messages(items: str | list[dict]) -> list[dict]:
    """Responses input items as chat messages: messages (text or input/output text parts),
    ``function_call`` items as the assistant's tool calls (joined to the assistant message
    before them), ``function_call_output`` as tool messages; reasoning items dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(f"input[{i}].role {role!r} is not a message role", param=f"input[{i}].role")
            out.append(
                {"role": "system" if role == "developer" else role, "content": _parts_text(item.get("content"), i)}
            )
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"},
            }
            if out and out[-1]["role"] == "assistant" and not out[-1].get("_closed"):
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else _parts_text(output, i),
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(f"input[{i}].type {kind!r} is not served", param=f"input[{i}].type")
    return out


def _parts_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise ApiError(f"input[{i}].content: only text parts are served", param=f"input[{i}].content")
            texts.append(part.get("text") or "")
        return "".join(texts)
    raise ApiError(f"input[{i}].content must be text or text parts", param=f"input[{i}].content")


# -- a sampled reply as a message ----------------------------------------------------------------
def reply_message(text: str, tools: Any, tool_choice: str = "auto") -> dict:
    """The assistant message: the reply's well-formed tool calls parsed when the request offered
    tools (and did not say ``none``); the text before the first call is its content."""
    calls = [c for c in parse_tool_calls(text) if not c.error] if tools and tool_choice != "none" else []
    if not calls:
        return {"role": "assistant", "content": text}
    head = text[: text.find("<tool_call>")].strip()
    return {
        "role": "assistant",
        "content": head or None,
        "tool_calls": [
            {
                "id": f"call_{uuid.uuid4().hex[:16]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in calls
        ],
    }


def finish_reason(message: dict, truncated: bool) -> str:
    return "tool_calls" if message.get("tool_calls") else ("length" if truncated else "stop")


# -- replies -------------------------------------------------------------------------------------
def _usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _chat_logprobs(c: Choice) -> dict:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(c.tokens, c.logprobs)
        ]
    }


def chat_reply(ask: Ask, choices: list[Choice], prompt_ids: list[int]) -> dict:
    out = []
    for i, c in enumerate(choices):
        choice: dict[str, Any] = {
            "index": i,
            "message": c.message,
            "finish_reason": c.finish,
            "token_ids": c.token_ids,
            "token_logprobs": c.logprobs,
            "logprobs": _chat_logprobs(c) if ask.logprobs else None,
        }
        out.append(choice)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": ask.model,
        "choices": out,
        "usage": _usage(len(prompt_ids), choices),
        "prompt_token_ids": prompt_ids,
    }


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n"


def chat_stream(ask: Ask, choices: list[Choice], prompt_ids: list[int]) -> Iterator[str]:
    """``chat.completion.chunk`` events: per choice its role, its content, its tool calls (one
    chunk each), then its finish with the sampled token ids and log-probs; the usage chunk
    when asked for; ``[DONE]``."""
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": ask.model,
    }

    def chunk(i: int, delta: dict, finish: str | None = None, **extra: Any) -> str:
        return sse({**head, "choices": [{"index": i, "delta": delta, "finish_reason": finish, **extra}]})

    for i, c in enumerate(choices):
        yield chunk(i, {"role": "assistant", "content": ""})
        if c.message.get("content"):
            yield chunk(i, {"content": c.message["content"]})
        for k, call in enumerate(c.message.get("tool_calls") or []):
            yield chunk(
                i,
                {
                    "tool_calls": [
                        {
                            "index": k,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]},
                        }
                    ]
                },
            )
        yield chunk(
            i,
            {},
            c.finish,
            token_ids=c.token_ids,
            token_logprobs=c.logprobs,
            logprobs=_chat_logprobs(c) if ask.logprobs else None,
        )
    if ask.include_usage:
        yield sse({**head, "choices": [], "usage": _usage(len(prompt_ids), choices), "prompt_token_ids": prompt_ids})
    yield sse("[DONE]")


def completion_reply(ask: Ask, choices: list[Choice], prompt_ids: list[int]) -> dict:
    out = [
        {
            "index": i,
            "text": c.text,
            "finish_reason": c.finish,
            "token_ids": c.token_ids,
            "token_logprobs": c.logprobs,
            "logprobs": _completion_logprobs(c) if ask.logprobs else None,
        }
        for i, c in enumerate(choices)
    ]
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": ask.model,
        "choices": out,
        "usage": _usage(len(prompt_ids), choices),
        "prompt_token_ids": prompt_ids,
    }


def _completion_logprobs(c: Choice) -> dict:
    offsets, at = [], 0
    for t in c.tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": c.tokens, "token_logprobs": c.logprobs, "top_logprobs": None, "text_offset": offsets}


def completion_stream(ask: Ask, choices: list[Choice], prompt_ids: list[int]) -> Iterator[str]:
    reply = completion_reply(ask, choices, prompt_ids)
    head = {k: reply[k] for k in ("id", "object", "created", "model")}
    for choice in reply["choices"]:  # one chunk each: the openai types require a finish reason
        yield sse({**head, "choices": [choice]})
    if ask.include_usage:
        yield sse({**head, "choices": [], "usage": reply["usage"], "prompt_token_ids": prompt_ids})
    yield sse("[DONE]")


def response_output(choice: Choice) -> list[dict]:
    """A reply as Responses output items: its text as a message, each tool call as a
    ``function_call`` item (carrying the sampled token ids on the last item)."""
    items: list[dict] = []
    content = choice.message.get("content")
    if content or not choice.message.get("tool_calls"):
        items.append(
            {
                "id": f"msg_{uuid.uuid4().hex}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": content or "", "annotations": [], "logprobs": []}],
            }
        )
    for call in choice.message.get("tool_calls") or []:
        items.append(
            {
                "id": f"fc_{uuid.uuid4().hex}",
                "type": "function_call",
                "status": "completed",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
            }
        )
    return items


def responses_reply(
    ask: Ask,
    choice: Choice,
    prompt_ids: list[int],
    response_id: str,
    output: list[dict] | None = None,
    status: str = "completed",
) -> dict:
    n_out = len(choice.token_ids)
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": ask.model,
        "output": response_output(choice) if output is None else output,
        **ask.echo,
        "incomplete_details": {"reason": "max_output_tokens"} if choice.finish == "length" else None,
        "usage": {
            "input_tokens": len(prompt_ids),
            "output_tokens": n_out,
            "total_tokens": len(prompt_ids) + n_out,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
        "token_ids": choice.token_ids,
        "token_logprobs": choice.logprobs,
        "prompt_token_ids": prompt_ids,
    }


def responses_stream(ask: Ask, choice: Choice, prompt_ids: list[int], response_id: str) -> Iterator[str]:
    """The event sequence both the Agents SDK (which reads ``response.completed``) and LangChain
    (which builds the message from the deltas) need."""
    seq = iter(range(10**9))
    final = responses_reply(ask, choice, prompt_ids, response_id)

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\n" + sse({"type": kind, "sequence_number": next(seq), **data})

    pending = {**final, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    for k, item in enumerate(final["output"]):
        yield from _item_events(event, k, item)
    yield event("response.completed", response=final)


def _item_events(event: Callable[..., str], k: int, item: dict) -> Iterator[str]:
    ids = {"item_id": item["id"], "output_index": k}
    if item["type"] == "message":
        text = item["content"][0]["text"]
        yield event("response.output_item.added", output_index=k, item={**item, "status": "in_progress", "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield event("response.content_part.added", **ids, content_index=0, part=part)
        yield event("response.output_text.delta", **ids, content_index=0, delta=text, logprobs=[])
        yield event("response.output_text.done", **ids, content_index=0, text=text, logprobs=[])
        yield event("response.content_part.done", **ids, content_index=0, part={**part, "text": text})
    else:
        yield event(
            "response.output_item.added", output_index=k, item={**item, "status": "in_progress", "arguments": ""}
        )
        yield event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
        yield event("response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"])
    yield event("response.output_item.done", output_index=k, item=item)
