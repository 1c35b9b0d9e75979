"""Your own agent program against the rollout endpoint, on a real in-process vLLM engine with the
real ``openai`` client: the calls of an episode join into one trajectory whose tokens and
log-probs are exactly those the program was given; a call that does not extend the conversation
starts a new segment; programs that fail are dropped and counted; bad calls are clear 400s."""

from __future__ import annotations

import concurrent.futures

import pytest
import requests
import torch

from actors.agents.agent_server import AgentEndpoint
from actors.agents.environments import EpisodeLimits
from actors.agents.chat_tokens import ChatTokens
from tests.helpers import agents


@pytest.fixture(scope="module")
def endpoint():
    ep = AgentEndpoint()
    yield ep
    ep.close()


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(8) as p:
        yield p


LIMITS = EpisodeLimits(max_turns=4, max_tokens=256, max_new_tokens=16)


def _rows(prompts: list[str], answers: list[str] | None = None) -> list[dict]:
    return [{"prompt": p, "answer": a, "meta": {"answer": a}} for p, a in zip(prompts, answers or ["0"] * len(prompts))]


def test_three_calls_are_one_trajectory_of_exactly_the_tokens_the_program_got(
    generator, endpoint, pool, tiny_model_path
):
    prompts = ["Tell me about seven.", "Count to three."]
    agents.SEEN.clear()
    exp, counts = generator.generate_agent_episodes(
        _rows(prompts), [0, 1], agents.three_turns, endpoint, LIMITS, pool=pool, seed=3
    )
    assert exp.batch_size == 2 and counts["segments"] == 2 and counts["turns"] == 6
    chat = ChatTokens(generator.tokenizer)
    for row, prompt in enumerate(prompts):
        seen = agents.SEEN[prompt]
        assert len(seen) == 3
        expected = chat.prompt_messages([{"role": "user", "content": prompt}])
        actions, logprobs = [False] * len(expected), [0.0] * len(expected)
        for k, call in enumerate(seen):
            expected += call["token_ids"]
            actions += [True] * len(call["token_ids"])
            logprobs += call["logprobs"]
            if k < 2:
                ended = call["token_ids"][-1] == generator.eos_token_id
                delta = chat.after_reply([{"role": "user", "content": f"Turn {k + 1}: go on."}], reply_ended=ended)
                expected += delta
                actions += [False] * len(delta)
                logprobs += [0.0] * len(delta)
        n = len(expected)
        assert exp.input_ids[row, :n].tolist() == expected and int(exp.attention_mask[row].sum()) == n
        assert exp.response_mask[row, :n].tolist() == actions
        assert torch.allclose(exp.rollout_logprobs[row, :n], torch.tensor(logprobs), atol=1e-6)
        assert exp.meta[row]["episode"]["calls"] == 3
        _check_against_the_model(generator.tokenizer, tiny_model_path, seen, expected, actions)


def _check_against_the_model(tokenizer, model_path: str, seen: list[dict], ids: list[int], actions: list[bool]):
    """Independent of what the endpoint returned: each reply's ids decode to its text, and its
    log-probs are what a transformers forward pass of the whole trajectory gives at its tokens."""
    from transformers import AutoModelForCausalLM

    for call in seen:
        assert tokenizer.decode(call["token_ids"], skip_special_tokens=True) == call["content"], call
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    recomputed = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    at_actions = recomputed[torch.tensor(actions[1:])]
    returned = torch.tensor([lp for call in seen for lp in call["logprobs"]])
    assert at_actions.shape == returned.shape
    # fp32 on both sides: equal to float rounding (the tiny model is peaked: log-probs near -0.01)
    torch.testing.assert_close(at_actions, returned, atol=1e-5, rtol=1e-4)


def test_a_call_that_does_not_extend_the_conversation_is_a_new_segment(generator, endpoint, pool):
    exp, counts = generator.generate_agent_episodes(
        _rows(["Say hi."]), [5], agents.with_side_call, endpoint, LIMITS, pool=pool
    )
    assert exp.batch_size == 2 and counts["segments"] == 2
    assert exp.group_ids.tolist() == [5, 5] and [m["episode"]["reward"] for m in exp.meta] == [1.0, 1.0]


def test_failing_programs_are_counted_and_bad_calls_refused(generator, endpoint, pool):
    rows = _rows([f"Task {i}." for i in range(5)], ["1", "2", "3", "4", "5"])
    exp, counts = generator.generate_agent_episodes(
        rows, list(range(5)), agents.misbehaving, endpoint, LIMITS, pool=pool
    )
    assert exp.skipped["agent_error"] == 2  # raised; returned garbage
    assert exp.skipped["agent_no_calls"] == 1  # its only call was refused (an unknown model)
    # Mode 4 called six times with the same first message: four answered (env.max_turns), each a
    # segment of its own (none extends another), two refused; mode 5 made one call.
    assert sorted(m["episode"]["reward"] for m in exp.meta) == [0.0, 2.0, 2.0, 2.0, 2.0]
    assert counts["refused_calls"] == 3
    # Outside a running batch, or with a token nobody issued: 404.
    url = endpoint.base_url("no-such-episode")
    assert requests.post(f"{url}/chat/completions", json={"messages": []}, timeout=10).status_code == 404


def test_replies_offering_tools_carry_tool_calls_and_the_next_call_continues_them():
    """With ``tools`` in the request a reply's Hermes calls come back as ``tool_calls``; the
    program sends that message back (arguments as a JSON string, maybe reformatted) with the
    tool's answer, and the conversation still counts as the same trajectory."""
    import json

    from actors.agents.agent_endpoint import _norm
    from actors.agents.openai_api import reply_message as _reply_message
    from actors.agents.tools import CALCULATOR

    text = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    reply = _reply_message(text, [CALCULATOR.schema()])
    assert reply["content"] == "Let me compute." and reply["tool_calls"][0]["function"]["name"] == "calculator"
    assert json.loads(reply["tool_calls"][0]["function"]["arguments"]) == {"expression": "6*7"}
    assert _reply_message(text, None) == {"role": "assistant", "content": text}  # no tools offered: plain text
    echoed = {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "calculator", "arguments": '{"expression":"6*7"}'}}
        ],
    }
    assert _norm(echoed) == _norm(reply)
    assert _norm({**echoed, "content": "changed"}) != _norm(reply)
