"""A conversation demonstration trains the assistant's turns only, on the token ids a multi-turn
rollout of the same conversation records; tool-use transcripts written by code are conversations
the tool_use environment itself would have answered the same way."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from actors.agents.environments import EnvSpec, environment_factory
from actors.agents.chat_tokens import ChatTokens, tool_instructions
from actors.data.offline_data import encode_demonstrations, normalise_demonstration
from actors.data.tasks import reasoning_gym_rows
from actors.agents.tools import CALCULATOR
from actors.agents.transcripts import calculator_transcript, resolve_transcripts, transcript_demonstrations

TOOLS = [CALCULATOR.schema()]
CONVERSATION = [
    {"role": "user", "content": "What is 12 * 34?"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>',
    },
    {"role": "tool", "content": "<tool_response>\n408\n</tool_response>"},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "408"},
]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _encode(tok, rows, **kw):
    return encode_demonstrations(rows, tok, **{"max_prompt_tokens": 2048, "max_response_tokens": 256, **kw})


def test_the_record_is_the_whole_conversation_and_only_assistant_turns_are_trained(tok):
    row, reason = normalise_demonstration({"messages": CONVERSATION, "tools": TOOLS})
    assert reason is None
    exp, skipped = _encode(tok, [row])
    assert skipped == {}
    ids = exp.input_ids[0][exp.attention_mask[0]].tolist()
    # The chat template's own rendering of the conversation, tools listed in the system message
    # (this template renders no tools itself), up to the last reply's end token.
    full = tok.apply_chat_template(
        [{"role": "system", "content": tool_instructions(TOOLS)}] + CONVERSATION, tokenize=False
    )
    assert full.startswith(tok.decode(ids)) and full[len(tok.decode(ids)) :].strip() == ""
    # Trained: each assistant turn's text and its EOS, nothing else.
    mask = exp.response_mask[0][exp.attention_mask[0]]
    trained = torch.tensor(ids)[mask].tolist()
    want = [
        t
        for m in CONVERSATION
        if m["role"] == "assistant"
        for t in tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ]
    assert trained == want
    assert exp.completions == [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>\n408'
    ]


def test_the_ids_are_those_a_rollout_records_turn_by_turn(tok):
    """The rollout's construction (``actors/agents/episodes.py``): the first observation's prompt, the
    sampled reply and its EOS, then each observation tokenised after it."""
    chat = ChatTokens(tok)
    reply_1 = tok(CONVERSATION[1]["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    reply_2 = tok("408", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rollout = (
        chat.prompt(CONVERSATION[0], TOOLS) + reply_1 + chat.after_reply(CONVERSATION[2:4], reply_ended=True) + reply_2
    )
    exp, _ = _encode(tok, [normalise_demonstration({"messages": CONVERSATION, "tools": TOOLS})[0]])
    assert exp.input_ids[0][exp.attention_mask[0]].tolist() == rollout


def test_bad_conversations_are_counted_by_reason():
    bad = [
        ({"messages": []}, "missing_field"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "missing_field"),  # nothing to train
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "missing_field"),  # no context
        ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "hi"}]}, "missing_field"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}, "missing_field"),
        ({"messages": "hello"}, "malformed_row"),
        ({"messages": [{"role": "user", "content": 3}]}, "malformed_row"),
        ({"messages": CONVERSATION, "tools": "calculator"}, "malformed_row"),
    ]
    for obj, reason in bad:
        assert normalise_demonstration(obj) == (None, reason), obj


def test_budgets_count_over_long_conversations(tok):
    row = normalise_demonstration({"messages": CONVERSATION})[0]
    assert _encode(tok, [row], max_response_tokens=3)[1] == {"too_long": 1}  # a turn over its budget
    assert _encode(tok, [row], max_total_tokens=20)[1] == {"too_long": 1}  # the whole row
    assert _encode(tok, [row], max_prompt_tokens=4)[1] == {"too_long": 1}


def test_calculator_transcripts_are_what_the_tool_use_environment_answers():
    rows = reasoning_gym_rows(
        "basic_arithmetic",
        24,
        3,
        {"min_terms": 2, "max_terms": 3, "min_digits": 2, "max_digits": 3},
        "Answer with just the final answer.",
    ).rows
    demos, skipped = transcript_demonstrations(rows, resolve_transcripts("calculator"), TOOLS)
    assert len(demos) + sum(skipped.values()) == len(rows) and len(demos) >= 20
    make = environment_factory(EnvSpec("tool_use", verifier="reasoning_gym", tools=["calculator"]))
    for demo in demos:
        row = rows[demo["index"]]
        env = make()
        msgs = demo["messages"]
        assert env.reset(row) == msgs[0]["content"] and env.tools == demo["tools"]
        step = env.step(msgs[1]["content"])  # the transcript's call, answered by the environment
        assert step.observation == msgs[2] and not step.done
        final = env.step(msgs[3]["content"])
        assert final.done and final.reward == 1.0


def test_rows_without_a_transcript_are_counted():
    good = {"prompt": "Calculate 2 + 3.", "answer": "5", "meta": {"expression": "2 + 3"}}
    rows = [
        good,
        {"prompt": "Calculate.", "answer": "5", "meta": {}},  # no expression
        {"prompt": "Calculate 2 + 2.", "answer": "5", "meta": {"expression": "2 + 2"}},  # the tool disagrees
        {"prompt": "x", "answer": "1", "meta": {"expression": "import os"}},
    ]  # not arithmetic
    demos, skipped = transcript_demonstrations(rows, calculator_transcript, TOOLS)
    assert [d["index"] for d in demos] == [0] and skipped == {"no_transcript": 3}
    call = json.loads(demos[0]["messages"][1]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert call == {"name": "calculator", "arguments": {"expression": "2 + 3"}}

    def raises(row):
        raise RuntimeError("boom")

    assert transcript_demonstrations([good], raises, TOOLS) == ([], {"transcript_error": 1})
    assert transcript_demonstrations([good], lambda row: "not messages", TOOLS) == ([], {"transcript_error": 1})
    with pytest.raises(ValueError, match="neither built in"):
        resolve_transcripts("abacus")
    with pytest.raises(ValueError, match="no_such_module"):
        resolve_transcripts("no_such_module:fn")


def test_a_run_gets_transcripts_from_its_task_with_the_env_tools(tmp_path):
    from cluster.config import ConfigError, UserError
    from cluster.config.loading import load_config
    from cluster.data.sources import load_demonstrations

    sets = [
        "run.algorithm=sft",
        "sft.transcripts=calculator",
        "env.name=tool_use",
        "env.tools=[calculator, python]",
        "data.train_size=12",
        "data.eval_size=4",
        "data.task_kwargs={min_terms: 2, max_terms: 2, min_digits: 2, max_digits: 2}",
    ]
    cfg = load_config("configs/calculator_smollm2.yaml", sets)
    train, held, description = load_demonstrations(cfg)
    assert len(train.rows) == 12 and len(held.task_rows) == 4 and "calculator transcripts" in description
    assert [t["function"]["name"] for t in train.rows[0]["tools"]] == ["calculator", "python"]
    assert train.rows[0]["messages"][1]["content"].startswith("<tool_call>")
    with pytest.raises(UserError, match="sft.transcripts"):
        load_demonstrations(load_config("configs/calculator_smollm2.yaml", sets + ["sft.transcripts=abacus"]))
    demos = tmp_path / "d.jsonl"
    demos.write_text('{"prompt": "q", "response": "a"}\n')
    with pytest.raises(ConfigError, match="leave data.demonstration_file empty"):
        load_config("configs/calculator_smollm2.yaml", sets + [f"data.demonstration_file={demos}"])
