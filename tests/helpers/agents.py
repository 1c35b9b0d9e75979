"""Agent programs for tests, named in configs as ``tests.helpers.agents:<function>``: each plays
one episode with the real ``openai`` client against the rollout endpoint and returns its reward."""

from __future__ import annotations

import openai

from actors.rewards.functions import digit_density

# What each episode's program saw, by its row's prompt (in-process tests read it).
SEEN: dict[str, list[dict]] = {}


def three_turns(row: dict, base_url: str) -> float:
    """Three calls, each extending the conversation with the reply and a user message; the reward
    is the digit density of the first reply (credit across turns)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": row["prompt"]}]
    seen = SEEN.setdefault(row["prompt"], [])
    replies = []
    for k in range(3):
        r = client.chat.completions.create(model="policy", messages=messages, max_tokens=12, logprobs=True)
        choice = r.choices[0]
        seen.append(
            {
                "token_ids": choice.model_extra["token_ids"],
                "logprobs": [c.logprob for c in choice.logprobs.content],
                "content": choice.message.content,
            }
        )
        replies.append(choice.message.content)
        messages += [
            {"role": "assistant", "content": choice.message.content},
            {"role": "user", "content": f"Turn {k + 1}: go on."},
        ]
    return digit_density([""], [replies[0]])[0]


def with_side_call(row: dict, base_url: str) -> float:
    """Two calls that do not extend each other (two segments of one episode)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    a = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=6
    )
    b = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "Summarise: " + row["prompt"]}], max_tokens=6
    )
    return float(bool(a.choices[0].message.content is not None and b.choices[0].message.content is not None))


def misbehaving(row: dict, base_url: str) -> float:
    """By the row's answer: 1 raises, 2 returns garbage, 3 asks for a model the endpoint does not
    serve (refused, then gives up), 4 makes too many calls (the later ones refused), else one
    plain call."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    mode = int(row["answer"])
    msgs = [{"role": "user", "content": row["prompt"]}]
    if mode == 1:
        raise RuntimeError("the agent crashed")
    if mode == 2:
        client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
        return "not a number"  # type: ignore[return-value]
    if mode == 3:
        try:
            client.chat.completions.create(model="gpt-unknown", messages=msgs, max_tokens=4)
        except openai.BadRequestError:
            return 0.0
    refused = 0
    for _ in range(6 if mode == 4 else 1):
        try:
            client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
        except openai.BadRequestError:
            refused += 1
    return float(refused)
