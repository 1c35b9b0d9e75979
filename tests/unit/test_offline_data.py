"""Preference rows: every unusable row counted by reason; JSONL and Parquet; pairs encoded for
the DPO learner (shared prompt, EOS-terminated replies, over-long pairs counted)."""

import json
import math

import pytest
import torch

from actors.data.offline_data import encode_pairs, read_preferences, write_preferences
from learners.training.modeling import sequence_logprobs
from tests.helpers.factories import make_dpo_learner, tiny_lm

USER = {"role": "user", "content": "What is 2 + 3?"}
GOOD = [
    {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"},
    {"prompt": [USER], "chosen": "The answer is 5.", "rejected": "It is 7."},
    # Conversational: no prompt field, the shared context before the assistant's reply is the prompt.
    {
        "chosen": [USER, {"role": "assistant", "content": "5"}],
        "rejected": [USER, {"role": "assistant", "content": "4"}],
    },
]
BAD = [
    ("{not json", "malformed_row"),
    (json.dumps([1, 2]), "malformed_row"),
    (json.dumps({"prompt": "q", "chosen": "a"}), "missing_field"),
    (json.dumps({"prompt": "q", "chosen": "same", "rejected": " same "}), "identical_pair"),
    (json.dumps({"prompt": "q", "chosen": [USER], "rejected": "b"}), "malformed_row"),  # no assistant reply
    (
        json.dumps(
            {
                "chosen": [USER, {"role": "assistant", "content": "5"}],
                "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "4"}],
            }
        ),
        "missing_field",
    ),  # contexts differ: no common prompt
    (json.dumps({"prompt": 3, "chosen": "a", "rejected": "b"}), "malformed_row"),
]


def _file(tmp_path):
    lines = [json.dumps(r) for r in GOOD] + [line for line, _ in BAD]
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join(lines) + "\n\n")
    return path


def test_every_bad_row_is_counted_by_reason(tmp_path):
    prefs = read_preferences(_file(tmp_path))
    assert len(prefs) == 3
    expected: dict[str, int] = {}
    for _, reason in BAD:
        expected[reason] = expected.get(reason, 0) + 1
    assert prefs.skipped == expected
    assert len(prefs) + sum(prefs.skipped.values()) == len(GOOD) + len(BAD)
    assert [r["prompt"] for r in prefs.rows] == [[USER]] * 3
    assert [(r["chosen"], r["rejected"]) for r in prefs.rows] == [
        ("5", "6"),
        ("The answer is 5.", "It is 7."),
        ("5", "4"),
    ]
    with pytest.raises(FileNotFoundError, match="preference file not found"):
        read_preferences(tmp_path / "missing.jsonl")


def test_parquet_round_trip(tmp_path):
    rows = read_preferences(_file(tmp_path)).rows
    path = write_preferences(tmp_path / "prefs.parquet", [{**r, "judge_chosen": 4.5} for r in rows])
    back = read_preferences(path)
    assert back.skipped == {}
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in back.rows] == [
        (r["prompt"], r["chosen"], r["rejected"]) for r in rows
    ]


def test_encoded_pairs_share_their_prompt_and_end_with_eos(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    rows = [
        {"prompt": [USER], "chosen": "5", "rejected": "six, I think"},
        {"prompt": [USER], "chosen": "word " * 50, "rejected": "x"},  # chosen over the budget
        {"prompt": [{"role": "user", "content": "Name a colour."}], "chosen": "Blue.", "rejected": "Seven."},
    ]
    exp, skipped = encode_pairs(rows, tok, max_prompt_tokens=64, max_response_tokens=16)
    assert skipped == {"too_long": 1} and exp.skipped == {"too_long": 1}
    assert exp.batch_size == 4 and exp.group_ids.tolist() == [0, 0, 1, 1] and exp.scores.tolist() == [1, 0, 1, 0]
    for pair in (0, 1):
        w, l_ = 2 * pair, 2 * pair + 1
        start = int(exp.response_mask[w].long().argmax())
        assert start == int(exp.response_mask[l_].long().argmax())
        assert torch.equal(exp.input_ids[w, :start], exp.input_ids[l_, :start])
        for r in (w, l_):
            last = int(exp.attention_mask[r].sum()) - 1
            assert exp.input_ids[r, last] == tok.eos_token_id and exp.response_mask[r, last]
    assert tok.decode(exp.input_ids[1][exp.response_mask[1]][:-1]) == "six, I think"
    assert exp.completions == ["5", "six, I think", "Blue.", "Seven."]


def test_encoded_pairs_train_the_dpo_learner(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    rows = [
        {"prompt": [USER], "chosen": "5", "rejected": "six"},
        {"prompt": [{"role": "user", "content": "Name a colour."}], "chosen": "Blue.", "rejected": "Seven."},
    ]
    exp, _ = encode_pairs(rows, tok, max_prompt_tokens=64, max_response_tokens=16)
    lm = tiny_lm(tiny_model_path)
    with torch.no_grad():
        ref = sequence_logprobs(lm, exp.input_ids, exp.attention_mask, exp.response_mask)
    m = make_dpo_learner(tiny_model_path).train_step(exp.replace(ref_logprobs=ref))
    assert m["learner/pairs"] == 2 and m["loss/total"] == pytest.approx(math.log(2), abs=1e-5)
    assert m["learner/prefix_shared_frac"] == 1.0  # each pair ran its prompt once
