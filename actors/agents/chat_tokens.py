"""The chat template's token ids of a conversation, computed from its text: a prompt, and the
ids between a reply the model sampled and its next reply (``ChatTokens``); and a client's OpenAI
messages as the model saw such turns in training (``from_client``).

Rollouts keep the model's own tokens as sampled and tokenise only what comes between them:
multi-turn episodes (``actors/agents/episodes.py``), agent programs' calls (``actors/agents/agent_endpoint.py``),
the policy server (``serving/policy.py``) and conversation demonstrations (``actors/data/offline_data.py``).
"""

from __future__ import annotations

from typing import Any

from actors.agents.tools import ToolCallFormat

_SENTINEL = "RAYRLHF_REPLY_SENTINEL"


class ChatTokens:
    """The chat template's token ids for an episode's prompt and for each observation after a
    reply, computed from the template's text so that any template works the same way."""

    def __init__(self, tokenizer: Any, system_prompt: str = "") -> None:
        self.tok, self.system = tokenizer, system_prompt
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""
        # A placeholder conversation whose reply the observations follow, rendered once.
        self._base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        before = self._render(self._base)
        self._head = before[: before.index(_SENTINEL) + len(_SENTINEL)]
        # Whether the template renders a tool list itself, per tool list (asked once each).
        self._tools_rendered: dict[str, bool] = {}

    def _render(self, messages: list[dict], tools: list[dict] | None = None, generation: bool = False) -> str:
        return self.tok.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation
        )

    def prompt(self, first: Any, tools: list[dict] | None = None) -> list[int]:
        """The first turn's prompt: system message, the first observation, the generation prompt."""
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [as_message(first)]
        return self.prompt_messages(messages, tools)

    def prompt_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """A conversation as the prompt of its next reply. Tools the template does not render
        itself go into the system message."""
        return self._encode(self._render(self.with_tools(messages, tools), tools, generation=True))

    def with_tools(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """The messages the template renders: the tool list in the system message where the
        template renders no tools itself (the way every rollout of rayrlhf lists them)."""
        if not tools or self.renders_tools(tools):
            return list(messages)
        listing = tool_instructions(tools)
        if messages and messages[0].get("role") == "system":
            return [{**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{listing}"}] + list(messages[1:])
        return [{"role": "system", "content": listing}] + list(messages)

    def renders_tools(self, tools: list[dict]) -> bool:
        """Whether the chat template renders this tool list itself (asked once per list)."""
        import json

        key = json.dumps(tools, sort_keys=True)
        if key not in self._tools_rendered:
            probe = [{"role": "user", "content": "x"}]
            self._tools_rendered[key] = self._render(probe, tools) != self._render(probe)
        return self._tools_rendered[key]

    def observation(self, obs: Any, reply_ended: bool) -> list[int]:
        """The ids between a reply's last sampled token and the next reply (``after_reply`` of one
        observation message)."""
        return self.after_reply([as_message(obs)], reply_ended)

    def after_reply(self, messages: list[dict], reply_ended: bool) -> list[int]:
        """The ids between a reply's last sampled token and the next reply: the template's end of
        the reply turn (minus the EOS the model already sampled, when it did), the turns of
        ``messages`` and the next generation prompt."""
        after = self._render(self._base + list(messages), generation=True)
        if not after.startswith(self._head):
            raise ValueError("the chat template renders an earlier turn differently once a turn follows it")
        suffix = after[len(self._head) :]
        if reply_ended and self.eos_text and suffix.startswith(self.eos_text):
            suffix = suffix[len(self.eos_text) :]
        return self._encode(suffix)

    def _encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))


def as_message(obs: Any) -> dict[str, str]:
    if isinstance(obs, dict) and isinstance(obs.get("content"), str):
        return {"role": str(obs.get("role") or "user"), "content": obs["content"]}
    if isinstance(obs, str):
        return {"role": "user", "content": obs}
    raise TypeError(f"an observation must be text or a {{'role', 'content'}} message, got {type(obs).__name__}")


def from_client(messages: list[Any], fmt: ToolCallFormat = ToolCallFormat()) -> list[dict]:
    """A client's chat messages (OpenAI API) as the model saw such turns in training: an
    assistant message's ``tool_calls`` as the text the model writes (after its content, each call
    between the format's tags as ``{"name", "arguments"}`` JSON); consecutive ``tool`` messages as
    one, their answers joined inside the response tags (as the ``tool_use`` environment answers
    every call of a reply at once); content given as parts as its text. Other messages pass
    through unchanged, so a conversation without tools is left as it is."""
    import json

    out: list[dict] = []
    for m in messages:
        m = dict(m) if isinstance(m, dict) else m.model_dump(exclude_none=True)
        content = _text(m.get("content"))
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c.get("function") or {}
                args = fn.get("arguments")
                try:
                    args = json.loads(args) if isinstance(args, str) else (args or {})
                except json.JSONDecodeError:
                    pass  # what the model wrote, as it wrote it
                calls.append(fmt.open_tag + json.dumps({"name": fn.get("name"), "arguments": args}) + fmt.close_tag)
            # Exact for a reply that is calls only; text before the calls is joined by a line break.
            out.append(
                {"role": "assistant", "content": "\n".join(([content.rstrip()] if content.strip() else []) + calls)}
            )
        elif m.get("role") == "tool":
            if out and out[-1].get("_answers") is not None:
                out[-1]["_answers"].append(content)
            else:
                out.append({"role": "tool", "_answers": [content]})
        else:
            out.append({**{k: v for k, v in m.items() if k != "content"}, "content": content})
    for m in out:
        if "_answers" in m:
            m["content"] = fmt.wrap_response("\n".join(m.pop("_answers")))
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def tool_instructions(tools: list[dict]) -> str:
    import json

    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    return (
        "You can call these tools:\n<tools>\n" + listing + "\n</tools>\nTo call one, reply with "
        '<tool_call>{"name": <tool name>, "arguments": {...}}</tool_call> and wait for its answer.'
    )
