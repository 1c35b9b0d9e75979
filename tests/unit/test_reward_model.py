"""The reward-model learner: the Bradley–Terry loss by hand, gradients invariant to the
data-parallel split, a checkpoint that transformers loads as a sequence classifier with the same
rewards, exact resume, and learning on a separable toy preference."""

import math

import pytest
import torch

from learners.objectives.preference_losses import bradley_terry_loss
from learners.reward_model import load_reward_model, sequence_rewards
from tests.helpers.collective import run_ranks
from tests.helpers.factories import make_rm_learner, preference_batch, step_with_grads, tiny_lm


def test_bradley_terry_loss_by_hand():
    r_w, r_l = torch.tensor([1.0, 0.0, -2.0]), torch.tensor([0.0, 0.0, 1.0])
    expected = [math.log1p(math.exp(-1.0)), math.log(2.0), math.log1p(math.exp(3.0))]
    torch.testing.assert_close(bradley_terry_loss(r_w, r_l), torch.tensor(expected))
    # A margin m shifts the difference: -log sigma(1 - 0.5).
    assert float(bradley_terry_loss(r_w[:1], r_l[:1], margin=0.5)) == pytest.approx(math.log1p(math.exp(-0.5)))
    # Centering adds c * (r_w + r_l)^2 per pair.
    centred = bradley_terry_loss(r_w, r_l, center_coef=0.1)
    torch.testing.assert_close(centred, torch.tensor(expected) + 0.1 * (r_w + r_l) ** 2)


def test_loss_and_accuracy_match_a_naive_loop(tiny_model_path):
    learner = make_rm_learner(tiny_model_path)
    batch = preference_batch(tiny_lm(tiny_model_path), 4, ref_shift=None)
    with torch.no_grad():
        r = learner.rewards(batch)
    losses, correct = [], 0
    for g in range(4):
        a, b = 2 * g, 2 * g + 1
        w, l = (a, b) if batch.scores[a] > batch.scores[b] else (b, a)
        losses.append(-torch.nn.functional.logsigmoid(r[w] - r[l]))
        correct += int(r[w] > r[l])
    m = learner.evaluate(batch)
    assert m["eval/loss/total"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)
    assert m["eval/rewards/accuracy"] == pytest.approx(correct / 4)
    assert m["eval/pairs"] == 4


def test_two_learners_match_one(tiny_model_path):
    batch = preference_batch(tiny_lm(tiny_model_path), 5, seed=2, ref_shift=None)
    train = {"micro_batch_size": 2, "num_minibatches": 2}
    g1, m1 = step_with_grads(make_rm_learner(tiny_model_path, train=train), batch)
    learners = [make_rm_learner(tiny_model_path, train=train) for _ in range(2)]
    results = run_ranks(2, lambda rank, comm: step_with_grads(learners[rank], batch, comm))
    for g, m in results:
        torch.testing.assert_close(g["g"], g1["g"], atol=2e-6, rtol=1e-4)
        assert m["loss/total"] == pytest.approx(m1["loss/total"], rel=1e-5)
    assert g1["g"].abs().sum() > 0


def test_a_pair_runs_its_prompt_once_with_the_same_rewards_and_gradients(tiny_model_path):
    """``train.shared_prefix``: a pair's two rows run their shared prompt once (a packed tree
    row); the rewards, loss and gradients are those of running both rows in full."""
    batch = preference_batch(tiny_lm(tiny_model_path), 5, seed=8, ref_shift=None)
    out = {}
    for shared in (True, False):
        learner = make_rm_learner(tiny_model_path, seed=4, train={"shared_prefix": shared, "micro_batch_size": 4})
        with torch.no_grad():
            rewards = learner.rewards(batch)
        grads, metrics = step_with_grads(learner, batch)
        out[shared] = rewards, grads["g"], metrics
    (r1, g1, m1), (r0, g0, m0) = out[True], out[False]
    assert m1["learner/prefix_shared_frac"] == 1.0 and m0["learner/prefix_shared_frac"] == 0.0
    torch.testing.assert_close(r1, r0, atol=1e-5, rtol=1e-5)
    assert m1["loss/total"] == pytest.approx(m0["loss/total"], rel=1e-5)
    assert g0.abs().max() > 0
    torch.testing.assert_close(g1, g0, atol=3e-4 * float(g0.abs().max()), rtol=1e-4)


def test_checkpoint_is_a_sequence_classifier_with_the_same_rewards(tiny_model_path, tmp_path):
    learner = make_rm_learner(tiny_model_path, seed=3)
    batch = preference_batch(tiny_lm(tiny_model_path), 3, ref_shift=None)
    learner.train_step(batch)
    folder = learner.save(tmp_path / "rm", tokenizer_from=tiny_model_path)
    model = load_reward_model(folder)
    assert type(model).__name__.endswith("ForSequenceClassification") and model.config.num_labels == 1
    with torch.no_grad():
        mine = learner.rewards(batch)
        theirs, shared = sequence_rewards(model, batch.input_ids, batch.attention_mask)
        # transformers' own pooling on one unpadded sequence gives the same number.
        n = int(batch.attention_mask[0].sum())
        plain = model(input_ids=batch.input_ids[:1, :n]).logits[0, 0]
    torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=1e-5)
    assert shared is False  # no groups given: every row in full
    assert float(plain) == pytest.approx(float(mine[0]), abs=1e-5)


def test_resume_takes_the_same_next_step(tiny_model_path, tmp_path):
    batch = preference_batch(tiny_lm(tiny_model_path), 4, seed=4, ref_shift=None)
    a = make_rm_learner(tiny_model_path, seed=5)
    a.train_step(batch)
    folder = a.save(tmp_path / "ckpt")
    b = make_rm_learner(tiny_model_path, seed=99)  # another head init: restore must replace it
    b.restore(folder)
    assert b.version == a.version == 1
    ga, ma = step_with_grads(a, batch)
    gb, mb = step_with_grads(b, batch)
    torch.testing.assert_close(gb["g"], ga["g"])
    assert mb["loss/total"] == pytest.approx(ma["loss/total"], rel=1e-6)


def test_lora_is_refused(tiny_model_path):
    from cluster.config import LoRAConfig, RewardModelConfig, TrainConfig
    from learners.base import LearnerContext
    from learners.reward_model import RewardModelLearner

    ctx = LearnerContext(model_path=tiny_model_path, lora=LoRAConfig(enabled=True))
    with pytest.raises(ValueError, match="lora.enabled=false"):
        RewardModelLearner(ctx, TrainConfig(), RewardModelConfig())


def test_learns_a_separable_preference(tiny_model_path):
    """Chosen responses are the pairs' first rows: training accuracy rises from chance."""
    batch = preference_batch(tiny_lm(tiny_model_path), 8, seed=6, ref_shift=None)
    learner = make_rm_learner(tiny_model_path, train={"lr": 3e-3})
    start = learner.evaluate(batch)
    for _ in range(15):
        learner.train_step(batch)
    end = learner.evaluate(batch)
    assert end["eval/loss/total"] < start["eval/loss/total"] - 0.2
    assert end["eval/rewards/accuracy"] == 1.0


def test_reward_model_scorer_gives_the_learners_rewards(tiny_model_path, tmp_path):
    from actors.data.offline_data import encode_pairs
    from actors.rewards.reward_model import RewardModelScorer
    from transformers import AutoTokenizer

    learner = make_rm_learner(tiny_model_path, seed=7)
    folder = learner.save(tmp_path / "rm", tokenizer_from=tiny_model_path)
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "chosen": "4", "rejected": "five", "index": 0}]
    exp, _ = encode_pairs(
        rows, AutoTokenizer.from_pretrained(tiny_model_path), max_prompt_tokens=64, max_response_tokens=16
    )
    with torch.no_grad():
        expected = learner.rewards(exp).tolist()
    scorer = RewardModelScorer(str(folder), batch_size=1, max_tokens=64)
    values, skipped = scorer.score_texts(["What is 2 + 2?"] * 2, ["4", "five"], [{}, {}])
    assert values == pytest.approx(expected, abs=1e-5) and skipped == {}
    # Over the token budget: counted, never scored.
    values, skipped = RewardModelScorer(str(folder), max_tokens=8).score_texts(["What is 2 + 2?"], ["4"], [{}])
    assert values == [None] and skipped == {"reward_too_long": 1}


def test_reward_model_scorer_runs_a_groups_prompt_once_with_the_same_rewards(tiny_model_path, tmp_path):
    from actors.rewards.reward_model import RewardModelScorer

    folder = make_rm_learner(tiny_model_path, seed=5).save(tmp_path / "rm", tokenizer_from=tiny_model_path)
    # A GRPO batch: three samples of one prompt, interleaved with two of another.
    prompts = ["What is 2 + 2?", "Spell cat backwards.", "What is 2 + 2?", "Spell cat backwards.", "What is 2 + 2?"]
    replies = ["4", "tac", "five", "the word is tac", "2 + 2 = 4"]
    alone = RewardModelScorer(str(folder), batch_size=1)  # one row per forward: nothing to share
    expected, _ = alone.score_texts(prompts, replies, [{}] * 5)
    assert alone.last_metrics["scorer/rm_prompt_shared_frac"] == 0.0
    grouped = RewardModelScorer(str(folder), batch_size=8)
    values, skipped = grouped.score_texts(prompts, replies, [{}] * 5)
    assert grouped.last_metrics["scorer/rm_prompt_shared_frac"] == 1.0  # the shared pass ran
    assert values == pytest.approx(expected, abs=1e-5) and skipped == {}
    assert len(set(round(v, 4) for v in values)) == 5  # distinct rewards: each row read at its own reply
