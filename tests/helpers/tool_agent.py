"""A tiny model taught one tool-use conversation by rayrlhf's own SFT learner on a conversation
demonstration (``actors/data/offline_data.py``): a served model that really emits a tool call."""

from __future__ import annotations

from pathlib import Path

from actors.data.offline_data import encode_demonstrations, normalise_demonstration
from actors.agents.tools import CALCULATOR
from tests.helpers.factories import make_sft_learner

TOOLS = [CALCULATOR.schema()]
QUESTION = "What is 37 * 41?"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37 * 41"}}</tool_call>'
ANSWER = "1517"
CONVERSATION = [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": CALL},
    {"role": "tool", "content": "<tool_response>\n1517\n</tool_response>"},
    {"role": "assistant", "content": ANSWER},
]


def train_tool_caller(
    base: str, out: str | Path, steps: int = 60, conversations: list[tuple[list[dict], list[dict]]] | None = None
) -> tuple[Path, dict]:
    """``base`` fine-tuned on ``conversations`` ((messages, tools) pairs; default CONVERSATION
    with TOOLS; every assistant turn) until it reproduces them; the checkpoint folder and the
    last step's metrics."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    rows = []
    for messages, tools in conversations or [(CONVERSATION, TOOLS)]:
        row, reason = normalise_demonstration({"messages": messages, "tools": tools})
        assert reason is None, reason
        rows.append(row)
    batch, skipped = encode_demonstrations(rows, tok, max_prompt_tokens=4096, max_response_tokens=512)
    assert not skipped, skipped
    learner = make_sft_learner(base, train={"lr": 3e-3, "micro_batch_size": 1}, total_steps=steps)
    metrics: dict = {}
    for _ in range(steps):
        metrics = learner.train_step(batch)
    return learner.save(out, tokenizer_from=base), metrics
