"""Multi-turn agents on the real stack (vLLM generators running episodes, the environment's
reward through the scorer, Ray Train learners): a task whose one reward, given after the second
turn, depends only on the first reply, so that credit has to cross the environment's
observation. GRPO learns it while a generator is killed mid-episode, PPO with its critic learns
it (token-level Q-learning learns it too: tests/ray/test_qlearning.py); an agent program on the
real openai client trains through the rollout endpoint, and so do the OpenAI Agents SDK (its
Responses model, a function tool, run and streamed) and a streaming ``async def`` program, whose
trained rows are the tokens and log-probs their calls returned."""

from __future__ import annotations

import math
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config.loading import load_config
from cluster.driver import train
from cluster.ops.ledger import read_ledger, summarize
from tests.helpers.kills import kill_during_run, steps_logged
from tests.helpers.runs import rows

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
ENV = [
    "env.name=tests.helpers.environments:DigitsAcrossTurns",
    "env.max_turns=2",
    "run.plot=false",
    "run.save_final=false",
    "run.eval_every=0",
]
STEPS, PROMPTS, SAMPLES = 8, 4, 8


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_grpo_learns_across_turns_and_a_generator_killed_mid_episode_loses_nothing(ray_cluster, tmp_path):
    """The kill lands while the episodes of step 3 wait between their turns (the environment
    holds their second step until the test releases it, after the kill): the unit issued again
    goes on from the turn boundaries its episodes had reached (``tests/unit/test_episodes.py``),
    the ledger counts the turns taken over, and the run ends as the same run uninterrupted."""
    run_dir, hold = tmp_path / "grpo", tmp_path / "hold"
    sets = [
        *ENV,
        f"run.steps={STEPS}",
        "run.save_final=true",  # the final weights, compared with the uninterrupted run's
        "ppo.advantage_estimator=grpo",
        f"rollout.samples_per_prompt={SAMPLES}",
        f"rollout.prompts_per_step={PROMPTS}",
        "ppo.loss_agg=seq_mean_token_mean",
        f"env.args={{hold: {hold}}}",
    ]
    env = {**ray_cluster["env"], "RAY_ADDRESS": ray_cluster["address"]}
    cmd = [
        str(Path(sys.executable).parent / "rayrlhf"),
        "train",
        "configs/ppo_tiny.yaml",
        "--run-dir",
        str(run_dir),
        *[a for s in sets for a in ("--set", s)],
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def held() -> bool:  # from step 3 on, the environments hold their second step
        if steps_logged(run_dir) >= 2 and not Path(f"{hold}.arm").exists():
            Path(f"{hold}.arm").touch()
        return Path(f"{hold}.held").exists()

    try:
        # The environment's hold is inside the generator's ``generate`` (its episodes' steps run
        # on that process's threads): the kill lands there, at once.
        kills, out = kill_during_run(
            proc, run_dir, [(held, "GeneratorWorker", None)], after_kill=lambda: Path(f"{hold}.release").touch()
        )
    finally:
        Path(f"{hold}.release").touch()
    assert kills[0][0] == int(Path(f"{hold}.held").read_text()), kills  # the process the hold was in
    assert 2 <= kills[0][1] < STEPS, kills
    summary = summarize(read_ledger(run_dir))
    p = summary["prompts"]
    assert p["issued"] == p["scored"] == p["trained"] == STEPS * PROMPTS and p["lost"] == 0, p
    assert summary["restarts"] == {"generator": 1} and p["reissued"] >= 1, summary
    # Episodes of the interrupted unit that had finished their first turn did not sample it again.
    assert 1 <= summary["turns_resumed"] <= PROMPTS * SAMPLES, summary
    assert sum(r.get("episode/resumed", 0) for r in rows(run_dir)) >= 1
    got = [r for r in rows(run_dir) if r["step"] > 0]
    # Every episode ran its two turns (the environment ends it after the second reply).
    assert all(r["episode/turns_mean"] == 2.0 and r["episode/status_done"] == PROMPTS * SAMPLES for r in got)
    # fp32 engine and learner: the learner's log-probs of the trained tokens are the engine's
    # log-probs of the tokens it sampled, observation tokens in between (re-tokenised text would
    # give other tokens and log-probs far apart).
    assert max(r["logprob_gap/max_abs"] for r in got) < 1e-3
    rewards = [r["reward/mean"] for r in got]
    assert _mean(rewards[-3:]) > _mean(rewards[:2]) + 0.5, rewards
    assert "generator 0 died" in out
    assert all("value/mean" not in r and r["reward/n"] == PROMPTS * SAMPLES for r in got)  # GRPO: no critic
    # The samples of a prompt share its forward pass in the learner (identical prefixes found).
    assert all(r["learner/prefix_shared_frac"] == 1.0 for r in got), [r["learner/prefix_shared_frac"] for r in got]
    _ends_as_the_uninterrupted_run(run_dir, tmp_path / "uninterrupted", sets)


def _ends_as_the_uninterrupted_run(run_dir: Path, reference: Path, sets: list[str]) -> None:
    """The same run with nothing killed (its hold never armed), in this process: per-step rewards
    and the final weights equal the interrupted run's (fp32 engine and learners), so the unit issued
    again sampled the episodes the lost one would have, turn by turn."""
    import torch

    from learners.base import load_model_weights

    train(load_config(ROOT / "configs" / "ppo_tiny.yaml", sets), run_dir=reference)
    want = [r["reward/mean"] for r in rows(reference) if r["step"] > 0]
    assert [r["reward/mean"] for r in rows(run_dir) if r["step"] > 0] == pytest.approx(want, abs=1e-6)
    final = Path("checkpoints") / f"step_{STEPS:05d}"
    got, ref = load_model_weights(run_dir / final), load_model_weights(reference / final)
    assert got.keys() == ref.keys()
    for k in got:
        torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-4, msg=k)


def test_ppo_with_its_critic_learns_across_turns(ray_cluster, tmp_path):
    """PPO with the critic (the tiny preset's estimator): GAE runs over the model's own tokens,
    the observation between the turns skipped (``tests/unit/test_advantages.py:
    test_gae_hand_interior_mask_is_skipped``), so the value of the reward given after the second
    reply reaches the first reply's tokens that earned it, and the critic learns that value."""
    run_dir = tmp_path / "ppo"
    # A third of the preset's policy step: at 3e-3 the reward rose to 0.6 by step 7 and fell back
    # to 0.1 by step 12 on an AVX2-only CPU (the same run, deterministic there; float32 kernels
    # differ by instruction set), passing elsewhere. At 1e-3 it rose steadily to 0.85 there.
    train(load_config(ROOT / "configs" / "ppo_tiny.yaml", [*ENV, "run.steps=12", "train.lr=1e-3"]), run_dir=run_dir)
    got = [r for r in rows(run_dir) if r["step"] > 0]
    assert all(r["episode/turns_mean"] == 2.0 for r in got)
    rewards, values = [r["reward/mean"] for r in got], [r["value/mean"] for r in got]
    assert _mean(rewards[-3:]) > _mean(rewards[:2]) + 0.5, rewards
    assert _mean(values[-3:]) > _mean(values[:2]) + 0.3, values


def test_an_agent_program_with_the_openai_client_trains_through_the_rollout_endpoint(ray_cluster, tmp_path):
    """``rollout.agent``: each episode is a 3-call program on the real ``openai`` client against
    the generator's endpoint (tests/unit/test_agent_endpoint.py checks that the record holds the
    tokens and log-probs the program was given); the learners train on those tokens (their
    log-probs equal the engine's) and the reward, earned by the first reply, rises."""
    run_dir = tmp_path / "agent"
    cfg = load_config(
        ROOT / "configs" / "ppo_tiny.yaml",
        [
            "rollout.agent=tests.helpers.agents:three_turns",
            "run.steps=8",
            "ppo.advantage_estimator=grpo",
            # A reply rarely holds a digit at first: a few positives per step must carry the
            # update (measured over 6 seeds: 4 steps at lr 3e-3 left 2 of them near 0).
            "train.lr=5e-3",
            "ppo.loss_agg=seq_mean_token_mean",
            f"rollout.samples_per_prompt={SAMPLES}",
            f"rollout.prompts_per_step={PROMPTS}",
            "run.plot=false",
            "run.save_final=false",
        ],
    )
    train(cfg, run_dir=run_dir)
    got = [r for r in rows(run_dir) if r["step"] > 0]
    assert all(r["episode/turns_mean"] == 3.0 and r["episode/segments"] == PROMPTS * SAMPLES for r in got)
    assert max(r["logprob_gap/max_abs"] for r in got) < 1e-3
    rewards = [r["reward/mean"] for r in got]
    assert max(rewards[-3:]) > rewards[0] + 0.3, rewards


def test_dpo_pairs_the_best_and_worst_episode_of_a_prompt(ray_cluster, tmp_path):
    """DPO on episodes (``dpo.pairs=scorer``): of a prompt's candidate episodes the best and the
    worst by the environment's reward form a pair (checked against the rewards the environment
    itself logged for every episode it played); the pair rows are the episode records as sampled
    (the observation between the turns masked out), and DPO trains on them."""
    import pyarrow.parquet as pq
    import torch

    run_dir, env_log = tmp_path / "dpo", tmp_path / "episodes.jsonl"
    cfg = load_config(
        ROOT / "configs" / "ppo_tiny.yaml",
        [
            *ENV,
            f"env.args={{log: {env_log}}}",
            "run.algorithm=dpo",
            "dpo.pairs=scorer",
            "run.steps=2",
            "dpo.pairs_per_step=4",
            "dpo.pair_prompts=16",
            "dpo.candidates=8",
            "dpo.candidate_temperature=2.0",
        ],
    )
    train(cfg, run_dir=run_dir)
    got = [r for r in rows(run_dir) if r["step"] > 0]
    assert got[0]["pairs/candidates"] == 128 and got[0]["pairs/pairs"] > 0
    assert all(math.isfinite(r["loss/total"]) for r in got), got  # NaN and inf both fail
    played: dict[str, list[float]] = {}
    for line in env_log.read_text().splitlines():
        e = json.loads(line)
        played.setdefault(e["prompt"], []).append(e["reward"])
    table = pq.read_table(run_dir / "data" / "pairs.parquet").to_pylist()
    assert len(table) == got[0]["pairs/pairs"] and sum(map(len, played.values())) == 128
    for pair in table:
        rewards = played[pair["prompt"]]
        assert len(rewards) == 8, (pair["prompt"], rewards)
        assert pair["score_chosen"] == pytest.approx(max(rewards)), (pair["prompt"], rewards)
        assert pair["score_rejected"] == pytest.approx(min(rewards)), (pair["prompt"], rewards)
    pairs = torch.load(run_dir / "data" / "pairs.pt", weights_only=True)
    resp, att = pairs["response_mask"], pairs["attention_mask"]
    first = resp.long().argmax(1)
    # Every row: actions, then observation tokens (no actions), then actions again.
    for i in range(resp.shape[0]):
        after = resp[i, first[i] : int(att[i].sum())]
        assert not after.all() and after[0] and after[-1], after


def test_sdk_streaming_and_async_programs_train_on_the_tokens_their_calls_returned(
    ray_cluster, tmp_path, sdk_tool_caller
):
    """One ``async def`` program (``tests/helpers/sdk_agents.py:mixed``) plays each row with the
    client the row names: the Agents SDK run, the Agents SDK streamed, or two streamed chat
    turns. Each exported transition (the scored rows the learners train on) holds at its actions
    exactly the token ids and log-probs the HTTP responses of one episode carried, in order."""
    from actors.data.transitions import read_transitions
    from tests.helpers.tool_agent import ANSWER, QUESTION

    log, data, held = tmp_path / "calls", tmp_path / "tasks.jsonl", tmp_path / "held.jsonl"
    held.write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": "4", "client": "streaming_chat"}) + "\n")
    clients = ["agents_sdk", "agents_sdk_streamed", "streaming_chat"]
    data.write_text(
        "".join(
            json.dumps({"prompt": QUESTION, "answer": ANSWER, "client": c, "log": str(log)}) + "\n" for c in clients * 4
        )
    )
    run_dir = tmp_path / "sdks"
    cfg = load_config(
        ROOT / "configs" / "ppo_tiny.yaml",
        [
            f"model.path={sdk_tool_caller}",
            f"data.task={data}",
            f"data.eval_task={held}",
            "data.eval_size=1",
            "run.eval_every=0",
            "data.instruction=",
            "rollout.agent=tests.helpers.sdk_agents:mixed",
            "run.steps=2",
            "ppo.advantage_estimator=grpo",
            "rollout.samples_per_prompt=2",
            "rollout.prompts_per_step=6",
            "model.max_new_tokens=96",
            "model.max_prompt_tokens=512",
            "env.max_tokens=1000",
            "run.plot=false",
            "run.save_final=false",
            "run.export_transitions=true",
        ],
    )
    train(cfg, run_dir=run_dir)
    rows_trained, skipped = read_transitions(run_dir / "data" / "transitions")
    assert not skipped and len(rows_trained) == 2 * 6 * 2
    logged = [json.loads(p.read_text()) for p in sorted(log.glob("*.json"))]
    assert sorted(e["client"] for e in logged) == sorted(clients * 8)

    def wire(episode: dict) -> tuple[list[int], list[float]]:
        ids, lps = [], []
        for call in episode["calls"]:
            (choice,) = call["choices"]
            ids, lps = ids + choice["token_ids"], lps + choice["logprobs"]
        return ids, lps

    unmatched = [wire(e) for e in logged]
    for t in rows_trained:
        mask = t.action_mask or [True] * len(t.response_ids)
        ids = [x for x, a in zip(t.response_ids, mask) if a]
        lps = [x for x, a in zip(t.behaviour_logprobs, mask) if a]
        match = next(i for i, (w_ids, _) in enumerate(unmatched) if w_ids == ids)
        assert lps == pytest.approx(unmatched.pop(match)[1], abs=1e-6)
    assert not unmatched
    got = [r for r in rows(run_dir) if r["step"] > 0]
    assert max(r["logprob_gap/max_abs"] for r in got) < 1e-3
