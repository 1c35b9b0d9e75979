"""The ecosystem's agent programs against the rollout endpoint, unchanged, on a real in-process
vLLM engine: the OpenAI Agents SDK with its default (Responses) model and a function tool, run
and streamed; a LangGraph ReAct agent on ``langchain-openai``, plain and streaming; a streaming
``async def`` program on ``AsyncOpenAI``. The model is the tiny one taught the calculator
conversation (``tests/conftest.py:sdk_tool_caller``), so each agent really calls its tool, gets
the answer and answers. For every episode the record row (what the learner trains on) holds, at
its actions, exactly the token ids and log-probs the HTTP responses carried to the client (read
from the wire by the program, ``tests/helpers/sdk_agents.py``), one trajectory across the calls;
the log-probs equal a transformers forward pass over the row. Also: completions by text and by
token ids continue their trajectory, ``n > 1`` gives a segment per choice, and every malformed
request of the new kinds is a 400 naming its field, counted, with no episode lost silently."""

from __future__ import annotations

import pytest
import requests
import torch

from actors.agents.environments import EpisodeLimits
from tests.helpers import sdk_agents
from tests.helpers.tool_agent import ANSWER, QUESTION

LIMITS = EpisodeLimits(max_turns=4, max_tokens=1000, max_new_tokens=96)
ROWS = [{"prompt": QUESTION, "answer": ANSWER, "meta": {}}]


def _run(tool_caller_engine, program, rows=ROWS, n: int = 2, temperature: float = 0.0, limits=LIMITS):
    gen, endpoint, pool = tool_caller_engine
    sdk_agents.CALLS.clear()
    exp, counts = gen.generate_agent_episodes(
        rows, list(range(len(rows))), program, endpoint, limits, pool=pool, seed=5, n=n, temperature=temperature
    )
    return exp, counts, dict(sdk_agents.CALLS)


def _actions(exp, i: int) -> tuple[list[int], list[float]]:
    mask = exp.response_mask[i]
    return exp.input_ids[i][mask].tolist(), exp.rollout_logprobs[i][mask].tolist()


def _wire(calls: list[dict]) -> tuple[list[int], list[float]]:
    ids, lps = [], []
    for call in calls:
        (choice,) = call["choices"]
        ids += choice["token_ids"]
        lps += choice["logprobs"]
    return ids, lps


def _forward_logprobs(model, exp, i: int) -> torch.Tensor:
    n = int(exp.attention_mask[i].sum())
    ids = exp.input_ids[i, :n]
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
    return lp[exp.response_mask[i, 1:n]]


@pytest.mark.parametrize(
    "program", ["agents_sdk", "agents_sdk_streamed", "langgraph_react", "langgraph_react_streaming"]
)
def test_an_sdk_agent_calls_its_tool_and_trains_on_exactly_the_tokens_it_was_sent(
    tool_caller_engine, tool_caller_hf, program
):
    exp, counts, calls = _run(tool_caller_engine, getattr(sdk_agents, program))
    assert counts["status_done"] == 2 and counts["segments"] == 2 and counts["turns"] == 4
    # Each agent called the calculator (a reply with the call, then one with the answer) and
    # solved the task: the reward is what the program computed from the SDK's final output.
    assert [m["episode"]["reward"] for m in exp.meta] == [1.0, 1.0]
    route = "/responses" if program.startswith("agents_sdk") else "/chat/completions"
    assert all(len(c) == 2 and all(x["path"].endswith(route) for x in c) for c in calls.values())
    assert sorted(_wire(c)[0] for c in calls.values()) == sorted(_actions(exp, i)[0] for i in range(2))
    for i in range(exp.batch_size):
        ids, lps = _actions(exp, i)
        wire = next(c for c in calls.values() if _wire(c)[0] == ids)
        assert lps == pytest.approx(_wire(wire)[1], abs=1e-6)
        assert lps == pytest.approx(_forward_logprobs(tool_caller_hf, exp, i).tolist(), abs=1e-4)
        # The tool's answer sits between the two replies as context, not as an action.
        assert "<tool_response>\n1517\n</tool_response>" in exp.completions[i] and exp.completions[i].endswith(
            ANSWER + "<|im_end|>"
        )


def test_a_streaming_async_program_continues_its_conversation(tool_caller_engine, tool_caller_hf):
    exp, counts, calls = _run(tool_caller_engine, sdk_agents.streaming_chat, temperature=1.0)
    assert counts["status_done"] == 2 and counts["segments"] == 2 and counts["turns"] == 4
    for i in range(exp.batch_size):
        ids, lps = _actions(exp, i)
        wire = next(c for c in calls.values() if _wire(c)[0] == ids)
        assert lps == pytest.approx(_wire(wire)[1], abs=1e-6)
        assert lps == pytest.approx(_forward_logprobs(tool_caller_hf, exp, i).tolist(), abs=1e-4)


def _completions_then_ids(row: dict, base_url: str) -> float:
    """A text completion, its continuation by text, then by token ids; and a chat call with n=2."""
    client = sdk_agents.sync_client(row, base_url)
    first = client.completions.create(model="policy", prompt=row["prompt"], max_tokens=6)
    text = row["prompt"] + first.choices[0].text + " more"
    second = client.completions.create(model="policy", prompt=text, max_tokens=6)
    ids = second.model_extra["prompt_token_ids"] + second.choices[0].model_extra["token_ids"] + [5]
    client.completions.create(model="policy", prompt=ids, max_tokens=6, stream=True)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi."}], n=2, max_tokens=6)
    return 1.0


def test_completions_continue_by_text_and_by_ids_and_each_of_n_choices_is_a_segment(tool_caller_engine, tool_caller_hf):
    exp, counts, calls = _run(tool_caller_engine, _completions_then_ids, n=1, temperature=1.0)
    (wire,) = calls.values()
    assert [len(c["choices"]) for c in wire] == [1, 1, 1, 2]
    # Three completions are one trajectory; the chat call's two choices are two more segments.
    assert counts["segments"] == 3 and exp.batch_size == 3
    completion_ids = sum((c["choices"][0]["token_ids"] for c in wire[:3]), [])
    assert _actions(exp, 0)[0] == completion_ids
    assert sorted(_actions(exp, i)[0] for i in (1, 2)) == sorted(c["token_ids"] for c in wire[3]["choices"])
    for i in range(3):
        assert _actions(exp, i)[1] == pytest.approx(_forward_logprobs(tool_caller_hf, exp, i).tolist(), abs=1e-4)


BAD = [
    ("responses", {"model": "policy", "input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ("responses", {"model": "policy", "input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    (
        "responses",
        {
            "model": "policy",
            "input": "hi",
            "tool_choice": "required",
            "tools": [{"type": "function", "name": "f", "parameters": {}}],
        },
        "tool_choice",
    ),
    ("responses", {"model": "policy", "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("responses", {"model": "policy", "input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ("responses", {"model": "gpt-nope", "input": "hi"}, "model"),
    ("chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    (
        "chat/completions",
        {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "stream": "maybe"},
        "stream",
    ),
    (
        "chat/completions",
        {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
        "top_logprobs",
    ),
    ("chat/completions", {"model": "policy", "messages": [{"content": "hi"}]}, "messages[0].role"),
    ("completions", {"model": "policy", "prompt": ["a", "b"]}, "prompt"),
    ("completions", {"model": "policy", "prompt": "a", "echo": True}, "echo"),
    ("completions", {"model": "policy"}, "prompt"),
]


def _malformed(row: dict, base_url: str) -> float:
    """Every bad request above, then a body that is not JSON: all refused, nothing sampled."""
    answers = [requests.post(f"{base_url}/{route}", json=body, timeout=60) for route, body, _ in BAD]
    answers.append(requests.post(f"{base_url}/chat/completions", data=b"{not json", timeout=60))
    row["meta"]["answers"] = [(a.status_code, a.json()["error"].get("param")) for a in answers]
    return 0.0


def test_malformed_requests_are_400s_naming_the_field_and_the_episode_is_counted(tool_caller_engine):
    rows = [{"prompt": "x", "answer": "0", "meta": {}}, {"prompt": QUESTION, "answer": ANSWER, "meta": {}}]

    def program(row: dict, base_url: str) -> float:
        return _malformed(row, base_url) if row["prompt"] == "x" else sdk_agents.langgraph_react(row, base_url)

    exp, counts, _ = _run(tool_caller_engine, program, rows=rows, n=1)
    assert rows[0]["meta"]["answers"] == [(400, param) for _, _, param in BAD] + [(400, None)]
    # The malformed episode made no call that sampled: dropped and counted, the other one kept.
    assert exp.skipped["agent_no_calls"] == 1 and counts["refused_calls"] == len(BAD) + 1
    assert exp.batch_size == 1 and exp.meta[0]["episode"]["reward"] == 1.0
