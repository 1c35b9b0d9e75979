"""Multi-turn episodes on a real in-process vLLM engine (no Ray): the record's tokens are the
engine's sampled ids plus each observation's ids, turn by turn (never the text tokenised again);
environments that raise, hang or return garbage are dropped and counted while the others finish;
turn and token limits end episodes."""

from __future__ import annotations

import threading

import pytest
import torch

from actors.agents.environments import EpisodeLimits, Step
from actors.agents.chat_tokens import ChatTokens
from actors.agents.episodes import EpisodeRunner
from actors.agents.tools import CALCULATOR
from tests.helpers.environments import Unreliable
from tests.helpers.timeouts import scaled


class Scripted:
    """Three turns; observation k is 'Turn k: go on.'; reward 1 at the end."""

    def reset(self, row: dict) -> str:
        self.turn = 0
        return row["prompt"]

    def step(self, action: str) -> Step:
        self.turn += 1
        return Step(None, 1.0, True, {}) if self.turn == 3 else Step(f"Turn {self.turn}: go on.", 0.0, False, {})


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"Say something about {i}.", "answer": str(i), "meta": {"i": i}} for i in range(n)]


def test_trained_ids_are_the_sampled_ids_plus_the_observation_ids(generator, monkeypatch, tiny_model_path):
    sampled: dict[int, list[tuple[list[int], list[float]]]] = {}
    finished = EpisodeRunner.finished

    def spy(self, ep, output):  # what the engine returned, before the runner touches it
        comp = output.outputs[0]
        ids = list(comp.token_ids)
        sampled.setdefault(ep.key, []).append((ids, [s[t].logprob for t, s in zip(ids, comp.logprobs)]))
        finished(self, ep, output)

    monkeypatch.setattr(EpisodeRunner, "finished", spy)
    limits = EpisodeLimits(max_turns=3, max_tokens=256, max_new_tokens=12)
    # A high temperature: varied tokens (the random tiny model at 1.0 mostly repeats one token).
    exp, counts = generator.generate_episodes(_rows(4), [7, 8, 9, 10], Scripted, limits, n=2, seed=5, temperature=2.0)
    assert exp.batch_size == 8 and counts["turns"] == 24 and counts["status_done"] == 8
    assert exp.group_ids.tolist() == [7, 7, 8, 8, 9, 9, 10, 10]
    chat = ChatTokens(generator.tokenizer)
    retokenised_differently = 0
    for row in range(8):
        turns = sampled[row]
        expected, actions, logprobs = list(generator.encode_prompt(f"Say something about {row // 2}.")), [], []
        actions += [False] * len(expected)
        logprobs += [0.0] * len(expected)
        for k, (ids, lps) in enumerate(turns):
            expected += ids
            actions += [True] * len(ids)
            logprobs += lps
            if k < 2:
                obs = chat.observation(f"Turn {k + 1}: go on.", reply_ended=ids[-1] == generator.eos_token_id)
                expected += obs
                actions += [False] * len(obs)
                logprobs += [0.0] * len(obs)
            text = generator.tokenizer.decode(ids)
            retokenised_differently += generator.tokenizer.encode(text, add_special_tokens=False) != ids
        n = len(expected)
        assert exp.input_ids[row, :n].tolist() == expected
        assert exp.attention_mask[row].sum() == n
        assert exp.response_mask[row, :n].tolist() == actions
        assert torch.allclose(exp.rollout_logprobs[row, :n], torch.tensor(logprobs))
        assert exp.meta[row]["episode"]["turns"] == 3 and exp.meta[row]["episode"]["reward"] == 1.0
    # The case the rule exists for: decoding a reply and encoding it again gives other ids.
    assert retokenised_differently > 0
    # The learner's log-probs of the record's action tokens are the engine's (fp32 both sides, at
    # the sampling temperature).
    from transformers import AutoModelForCausalLM

    from learners.training.modeling import sequence_logprobs

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        lp = sequence_logprobs(lm, exp.input_ids, exp.attention_mask, exp.response_mask, temperature=2.0)
    gap = (lp - exp.rollout_logprobs)[exp.response_mask].abs().max()
    assert float(gap) < 1e-3


def test_failing_environments_are_dropped_and_counted_while_the_others_finish(generator):
    """Answers ending in 1-5 make the environment raise in reset, raise in step, hang, give a NaN
    reward, return garbage; 6 behaves. The call returns while the hung step is still held (by an
    event this test sets only afterwards). The step limit is the run's one setting, so the calls
    around the hung one live under it too: scaled with the suite's timeouts, not sub-second."""
    release, entered = threading.Event(), threading.Event()

    class Hangs(Unreliable):
        def step(self, action):
            if self.mode == 3:
                entered.set()
                release.wait()
                return Step(None, 1.0, True, {})
            return super().step(action)

    rows = [{"prompt": f"Task {d}.", "answer": str(d), "meta": {"answer": str(d)}} for d in (1, 2, 3, 4, 5, 6)]
    limits = EpisodeLimits(max_turns=2, max_tokens=200, max_new_tokens=8, step_timeout_s=scaled(1.0))
    try:
        exp, counts = generator.generate_episodes(rows, list(range(6)), lambda: Hangs(), limits)
        assert entered.is_set() and not release.is_set()
    finally:
        release.set()
    assert exp.skipped["env_error"] == 3 and exp.skipped["env_timeout"] == 1
    assert [m["answer"] for m in exp.meta] == ["4", "6"]
    rewards = [m["episode"]["reward"] for m in exp.meta]
    assert rewards[1] == 1.0 and rewards[0] != rewards[0]  # NaN: left to the scorer, which drops it
    assert counts["status_env_error"] == 3 and counts["status_done"] == 2
    with pytest.raises(ValueError, match="no episode of a batch of 1 finished"):
        generator.generate_episodes(rows[:1], [0], lambda: Hangs(), limits)


def test_turn_and_token_limits_end_episodes(generator):
    endless = lambda: type(
        "Endless",
        (),
        {
            "reset": lambda self, row: row["prompt"],  # noqa: E731
            "step": lambda self, a: Step("More.", 0.0, False, {}),
        },
    )()
    exp, counts = generator.generate_episodes(
        _rows(2), [0, 1], endless, EpisodeLimits(max_turns=3, max_tokens=256, max_new_tokens=6)
    )
    assert counts["status_max_turns"] == 2 and counts["turns"] == 6
    exp, counts = generator.generate_episodes(
        _rows(2), [0, 1], endless, EpisodeLimits(max_turns=50, max_tokens=120, max_new_tokens=16)
    )
    assert counts["status_max_tokens"] == 2
    assert int(exp.attention_mask.sum(1).max()) <= 120


def test_prompts_render_the_tools_and_observations_follow_the_template(generator):
    chat = ChatTokens(generator.tokenizer)
    text = generator.tokenizer.decode(chat.prompt("What is 37 * 41?", [CALCULATOR.schema()]))
    assert '"name": "calculator"' in text and "<tool_call>" in text and text.endswith("assistant\n")
    after_eos = generator.tokenizer.decode(chat.observation({"role": "tool", "content": "1517"}, reply_ended=True))
    cut = generator.tokenizer.decode(chat.observation("Go on.", reply_ended=False))
    assert after_eos.startswith("\n<|im_start|>tool\n1517") and cut.startswith("<|im_end|>\n<|im_start|>user\nGo on.")


def test_a_seeded_batch_samples_the_same_episodes_whatever_the_environments_timing(generator):
    """Each turn samples from its own seeded generator (seed, episode, turn), so which turns
    share the engine's batch (when the environments answer) does not change the samples."""
    import random
    import time

    class Jittery(Scripted):
        def step(self, action):
            time.sleep(random.random() * 0.05)
            return super().step(action)

    limits = EpisodeLimits(max_turns=3, max_tokens=256, max_new_tokens=10)
    a, _ = generator.generate_episodes(_rows(6), list(range(6)), Jittery, limits, n=2, seed=11)
    b, _ = generator.generate_episodes(_rows(6), list(range(6)), Jittery, limits, n=2, seed=11)
    c, _ = generator.generate_episodes(_rows(6), list(range(6)), Jittery, limits, n=2, seed=12)
    # The same tokens; their log-probs agree to float rounding (a batch of other shape sums differently).
    assert torch.equal(a.input_ids, b.input_ids) and torch.allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-4)
    assert not torch.equal(a.input_ids, c.input_ids)


def test_a_seeded_batch_large_enough_to_be_prefilled_in_chunks_runs(generator):
    """vLLM rewinds a seeded request's generator when it throws a chunked prefill's sample away;
    a CPU generator could not rewind and the engine raised. 256 episodes of ~60 prompt tokens are
    more than one engine step prefills."""
    limits = EpisodeLimits(max_turns=2, max_tokens=200, max_new_tokens=4)
    exp, counts = generator.generate_episodes(_rows(32), list(range(32)), Scripted, limits, n=8, seed=1)
    assert exp.batch_size == 256 and counts["status_max_turns"] == 256


def test_an_interrupted_batch_goes_on_from_its_last_turn_boundaries(generator):
    """The journal gets each episode's snapshot at every turn boundary. A second run of the batch
    given the snapshots after turn 1 (as if the first had died there) replays turn 1 into fresh
    environments, keeps the recorded turn (its log-probs are the snapshot's, not sampled again)
    and samples the rest: the same episodes as the uninterrupted run. An environment that
    answers the replay differently makes its episode start over, counted."""
    import itertools

    limits = EpisodeLimits(max_turns=3, max_tokens=256, max_new_tokens=10)
    journal: dict[int, list[dict]] = {}
    full, _ = generator.generate_episodes(
        _rows(4),
        list(range(4)),
        Scripted,
        limits,
        n=2,
        seed=5,
        journal=lambda key, snap: journal.setdefault(key, []).append(snap),
    )
    assert sorted(journal) == list(range(8)) and all([len(s["spans"]) for s in v] == [1, 2] for v in journal.values())
    resume = {k: v[0] for k, v in journal.items()}
    for snap in resume.values():  # marks what the second run must take over rather than sample
        snap["logprobs"] = [-1.25 if a else 0.0 for a in snap["action"]]
    again, counts = generator.generate_episodes(_rows(4), list(range(4)), Scripted, limits, n=2, seed=5, resume=resume)
    assert counts["resumed"] == 8 and counts["resumed_turns"] == 8 and "replay_mismatch" not in counts
    assert torch.equal(again.input_ids, full.input_ids)
    for i, meta in enumerate(again.meta):
        start, end, _ = meta["episode"]["spans"][0]
        offset = int((again.attention_mask[i] & ~again.response_mask[i]).long().cumprod(0).sum())  # prompt length
        lp = again.rollout_logprobs[i]
        assert torch.all(lp[offset + start : offset + end] == -1.25)  # turn 1: taken over
        later = again.response_mask[i].clone()
        later[: offset + end] = False
        assert torch.allclose(lp[later], full.rollout_logprobs[i][later], atol=1e-4)  # turns 2, 3: sampled
    counter = itertools.count()

    class Forgetful(Scripted):  # its answers differ from one life to the next
        def step(self, action):
            out = super().step(action)
            return out if out.done else Step(f"{out.observation} ({next(counter)})", 0.0, False, {})

    resume = {k: v[0] for k, v in journal.items()}
    _, counts = generator.generate_episodes(_rows(4), list(range(4)), Forgetful, limits, n=2, seed=5, resume=resume)
    assert counts["replay_mismatch"] == 8 and counts["status_done"] == 8 and "resumed" not in counts
