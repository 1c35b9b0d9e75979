"""The SFT learner: its loss is the prompt-masked NLL, N ranks take one rank's step, it learns;
demonstration rows are read, counted and encoded like preference rows."""

import json

import pytest
import torch

from actors.data.offline_data import encode_demonstrations, read_demonstrations
from learners.training.modeling import sequence_logprobs
from tests.helpers.collective import run_ranks
from tests.helpers.factories import experience, grouped_batch, make_sft_learner, step_with_grads, tiny_lm

TOL = dict(atol=2e-6, rtol=1e-4)


def _batch(path, n=5, seed=0):
    lm = tiny_lm(path)
    ids, att, rm = grouped_batch(lm.config.vocab_size, list(range(n)), seed=seed)
    return lm, experience(lm, ids, att, rm, [0.0] * n, groups=list(range(n)), ref_shift=None)


def test_loss_is_the_prompt_masked_nll(tiny_model_path):
    lm, batch = _batch(tiny_model_path)
    with torch.no_grad():
        lp = sequence_logprobs(lm, batch.input_ids, batch.attention_mask, batch.response_mask)
    expected = float(-(lp * batch.response_mask).sum() / batch.response_mask.sum())
    captured, m = step_with_grads(make_sft_learner(tiny_model_path, train={"micro_batch_size": 2}), batch)
    assert m["loss/total"] == pytest.approx(expected, rel=1e-5)
    assert m["learner/tokens"] == float(batch.response_mask.sum())
    assert captured["g"].abs().sum() > 0


def test_two_learners_match_one(tiny_model_path):
    _, batch = _batch(tiny_model_path, n=5, seed=1)
    train = {"micro_batch_size": 2, "num_minibatches": 2}
    (c1, m1) = step_with_grads(make_sft_learner(tiny_model_path, train=train), batch)
    learners = [make_sft_learner(tiny_model_path, train=train) for _ in range(2)]
    results = run_ranks(2, lambda rank, comm: step_with_grads(learners[rank], batch, comm))
    for c, m in results:
        torch.testing.assert_close(c["g"], c1["g"], **TOL)
        assert m["loss/total"] == pytest.approx(m1["loss/total"], rel=1e-5)


def test_sft_learns_its_demonstrations(tiny_model_path):
    _, batch = _batch(tiny_model_path, n=4, seed=2)
    learner = make_sft_learner(tiny_model_path, train={"lr": 3e-3})
    losses = [learner.train_step(batch)["loss/total"] for _ in range(6)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_demonstrations_are_read_counted_and_encoded(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    user = {"role": "user", "content": "What is 2 + 3?"}
    lines = [
        json.dumps({"prompt": "What is 2 + 3?", "response": "5"}),
        json.dumps({"response": [user, {"role": "assistant", "content": "It is 5."}]}),
        json.dumps({"prompt": "q"}),  # no response
        json.dumps({"prompt": "q", "response": [user]}),  # no assistant reply
        "not json",
        json.dumps({"prompt": "Say a lot.", "response": "word " * 40}),  # over the budget when encoded
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(lines) + "\n")
    demos = read_demonstrations(path)
    assert len(demos) == 3 and demos.skipped == {"missing_field": 1, "malformed_row": 2}
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    exp, skipped = encode_demonstrations(demos.rows, tok, max_prompt_tokens=64, max_response_tokens=16)
    assert skipped == {"too_long": 1} and exp.batch_size == 2
    assert exp.completions == ["5", "It is 5."]
    last = int(exp.attention_mask[1].sum()) - 1
    assert exp.input_ids[1, last] == tok.eos_token_id and exp.response_mask[1, last]
    m = make_sft_learner(tiny_model_path).train_step(exp)
    assert m["learner/sequences"] == 2 and m["loss/total"] > 0
