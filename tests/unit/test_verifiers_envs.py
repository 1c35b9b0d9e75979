"""verifiers environments, defined with the package's own classes (``tests/helpers/vf``), run
as they are by the package's own rollout (its ``Env.run``, harness, MCP tool server and
interception server) against the rollout endpoint of a real in-process vLLM engine: a tool
environment whose calculator the model really calls (the tiny model taught the package's tool
listing), and a three-turn environment. Each episode is one trajectory whose action tokens
decode to the replies in the package's own trace and whose log-probs equal a transformers
forward pass; the rubric's reward is the episode's, each function's score a component."""

from __future__ import annotations

import pytest
import torch

from actors.agents.environments import EpisodeLimits
from actors.agents.verifiers_env import VerifiersProgram, load_environment, task_rows

LIMITS = EpisodeLimits(max_turns=6, max_tokens=1000, max_new_tokens=96)


def _episodes(tool_caller_engine, env_id: str, n_rows: int, temperature: float, args: dict | None = None):
    gen, endpoint, pool = tool_caller_engine
    program = VerifiersProgram(env_id, args or {}, LIMITS.max_new_tokens, keep_traces=True)
    rows = task_rows(load_environment(env_id, args or {}))[:n_rows]
    exp, counts = gen.generate_agent_episodes(
        rows, list(range(n_rows)), program, endpoint, LIMITS, pool=pool, seed=3, temperature=temperature
    )
    return exp, counts, list(program.traces.values())


def _check_against_traces(gen, tool_caller_hf, exp, traces) -> None:
    """Each row's action spans decode to the assistant turns of one trace; its log-probs are a
    forward pass's."""
    tok = gen.tokenizer
    replies = sorted(tuple((m.content or "") for m in t.assistant_messages) for t in traces)
    spans = []
    for i in range(exp.batch_size):
        mask, ids = exp.response_mask[i], exp.input_ids[i]
        edges = torch.diff(torch.cat([torch.tensor([0]), mask.int(), torch.tensor([0])])).tolist()
        starts = [k for k, e in enumerate(edges) if e == 1]
        ends = [k for k, e in enumerate(edges) if e == -1]
        spans.append(
            tuple(tok.decode([t for t in ids[a:b].tolist() if t != tok.eos_token_id]) for a, b in zip(starts, ends))
        )
        n = int(exp.attention_mask[i].sum())
        with torch.no_grad():
            logits = tool_caller_hf(ids[None, :n]).logits[0, :-1]
        lp = torch.log_softmax(logits, -1).gather(1, ids[1:n, None])[:, 0][mask[1:n]]
        assert exp.rollout_logprobs[i][mask].tolist() == pytest.approx(lp.tolist(), abs=1e-4)
    return replies, sorted(spans)


def test_a_tool_environment_calls_its_mcp_tool_and_its_rubric_scores_the_episode(tool_caller_engine, tool_caller_hf):
    exp, counts, traces = _episodes(tool_caller_engine, "tests.helpers.vf.tools", 2, temperature=0.0)
    assert counts["status_done"] == 2 and counts["segments"] == 2 and counts["turns"] == 4
    # The harness called the calculator through the package's MCP server and the model answered.
    assert all(t.tool_messages and t.tool_messages[0].content == "1517" for t in traces)
    assert [m["episode"]["reward"] for m in exp.meta] == [pytest.approx(1.2)] * 2
    assert counts["reward/correct/sum"] == 2 and counts["reward/used_tool/sum"] == 2
    replies, spans = _check_against_traces(tool_caller_engine[0], tool_caller_hf, exp, traces)
    # The trace holds the call parsed from the reply; the row holds the reply as sampled.
    assert [s[1] for s in spans] == [r[-1] for r in replies] == ["1517", "1517"]
    assert all('"name": "calc_calculator"' in s[0] for s in spans)


def test_a_multi_turn_environment_is_one_trajectory_per_episode(tool_caller_engine, tool_caller_hf):
    exp, counts, traces = _episodes(tool_caller_engine, "tests.helpers.vf.multi_turn", 2, temperature=1.0)
    assert counts["status_done"] == 2 and counts["segments"] == 2 and counts["turns"] == 6
    assert counts["metric/turns/sum"] == 6 and counts["reward/digits/n"] == 2
    replies, spans = _check_against_traces(tool_caller_engine[0], tool_caller_hf, exp, traces)
    assert spans == replies and all(len(s) == 3 for s in spans)
    # The episode's reward is the rubric's weighted sum.
    for t in traces:
        assert t.reward == pytest.approx(t.rewards["digits"].score + 0.5 * t.rewards["every_turn"].score)


def test_an_environment_that_does_not_load_is_one_line_and_its_config_can_be_overridden():
    with pytest.raises(ValueError, match=r"verifiers:no_such_env_module: .*not found"):
        load_environment("no_such_env_module", {})
    with pytest.raises(
        ValueError,
        match=r"verifiers:tests.helpers.vf.tools: env.args: taskset.num_taskz: Extra inputs are not permitted$",
    ):
        load_environment("tests.helpers.vf.tools", {"taskset": {"num_taskz": 2}})
    assert len(task_rows(load_environment("tests.helpers.vf.tools", {"taskset": {"num_tasks": 3}}))) == 3
