"""TRL's GRPOTrainer on rayrlhf's multi-turn guessing game (the workload of ``benchmarks/vs_trl_agents.py``).

Runs in TRL's own environment (``make trl-env`` builds ``.venv-trl``). The game is rayrlhf's
``actors.agents.environments.GuessNumber`` itself, imported from the repository (the module and what it
imports are plain Python), and the episodes are played by rayrlhf's ``actors.agents.episodes.EpisodeRunner``
with its ``ChatTokens``: the same prompt ids, the same observation ids after each reply, the same
limits (turns, tokens per turn, tokens per episode) and the same reward (the sum of the game's
rewards). Only the generation and the training are TRL's. Two ways into TRL 1.16:

``--mode rollout_func`` (default): ``GRPOTrainer(rollout_func=...)``. Each turn of every running
    episode is generated in one batch by TRL's own ``GRPOTrainer._generate_single_turn`` (the code
    its tool loop uses: ``transformers`` ``generate`` by default, TRL's vLLM backend with
    ``use_vllm``), the environment answers with a user message as in rayrlhf, and the whole
    episode goes back to TRL as one completion whose observation tokens carry ``env_mask`` 0 (no
    loss). The episode's reward reaches the reward function as an extra field.
``--mode environment_factory``: TRL's tool environment: the game behind a ``guess(number)``
    tool, its reward through ``get_reward``. TRL then renders the tool schema with the chat
    template and only continues an episode while the model writes a parseable tool call; a
    plain-text reply ends it. SmolLM2's own chat template cannot render tool calls, which
    ``GRPOTrainer`` refuses at start; ``--chat-template FILE`` swaps in another (e.g. TRL's
    ``chat_templates/qwen2_5.jinja``), which changes the prompt: not the same workload, a probe.

    .venv-trl/bin/python benchmarks/trl_grpo_agents.py --prompts P.json --model DIR --out R.json [--save DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trl_colocate_sync import sync_record, use_reload_weights  # noqa: E402  (benchmarks/ is on sys.path)

# generate(list of prompt ids, rooms) -> per prompt (sampled ids, their log-probs or None)
Generate = Callable[[list[list[int]], list[int]], list[tuple[list[int], list[float] | None]]]


# -- playing episodes with rayrlhf's episode runner, generation by any batch generator ---------------
class _Now(concurrent.futures.Executor):
    """Runs each environment call at once in the caller's thread, so that every episode of a
    turn is ready again before the next batched ``generate`` (the turn-synchronous batching of
    TRL's own tool loop)."""

    def submit(self, fn, /, *args, **kwargs):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # EpisodeRunner guards its own calls; kept for completeness
            fut.set_exception(e)
        return fut


class _Completion:
    """What ``EpisodeRunner.finished`` reads of a vLLM ``CompletionOutput``."""

    def __init__(self, ids: list[int], logprobs: list[float] | None, text: str, ended: bool) -> None:
        self.token_ids = ids
        lps = logprobs if logprobs is not None else [0.0] * len(ids)
        self.logprobs = [{t: type("Logprob", (), {"logprob": lp})()} for t, lp in zip(ids, lps)]
        self.weight_versions = None
        self.text = text
        self.finish_reason = "stop" if ended else "length"


class TurnLoop:
    """The ``EngineLoop.stream`` of ``actors/agents/episodes.py`` on a batch generator: every episode whose
    environment has answered gets its next turn in one ``generate`` call."""

    def __init__(self, generate: Generate, tokenizer: Any, eos_ids: set[int]) -> None:
        self.generate, self.tok, self.eos = generate, tokenizer, eos_ids
        self.generate_s = 0.0
        self.turn_batches: list[int] = []
        self.verbose = bool(os.environ.get("TRL_AGENTS_VERBOSE"))

    def stream(self, feed: Any) -> None:
        while feed.expecting():
            batch = feed.ready()
            if not batch:
                feed.wait(0.01)
                continue
            t0 = time.perf_counter()
            outs = self.generate([req["prompt_token_ids"] for _, req, _ in batch], [room for _, _, room in batch])
            self.generate_s += time.perf_counter() - t0
            self.turn_batches.append(len(batch))
            if self.verbose:
                print(f"[turns] batch of {len(batch)}: {time.perf_counter() - t0:.1f}s", flush=True)
            for (ep, _, room), (ids, lps) in zip(batch, outs):
                ids, lps = list(ids)[:room], (list(lps)[:room] if lps is not None else None)
                ended = bool(ids) and ids[-1] in self.eos
                text = self.tok.decode(ids, skip_special_tokens=True)  # as vLLM's text: no stop token
                feed.finished(ep, _Output(_Completion(ids, lps, text, ended)))


class _Output:
    def __init__(self, comp: _Completion) -> None:
        self.outputs = [comp]


def play(rows: list[dict], generate: Generate, tokenizer: Any, settings: dict) -> tuple[list[Any], TurnLoop]:
    """One episode per row of the game in ``settings`` (rayrlhf's environment factory, episode
    runner, chat tokens and limits); returns the episodes and the loop (its generation time)."""
    from actors.agents.environments import EnvSpec, EpisodeLimits, environment_factory
    from actors.agents.episodes import ChatTokens, EpisodeRunner

    make_env = environment_factory(EnvSpec(settings["env"], dict(settings["env_args"])))
    limits = EpisodeLimits(
        max_turns=settings["max_turns"],
        max_tokens=settings["episode_max_tokens"],
        max_new_tokens=settings["max_new_tokens"],
        step_timeout_s=settings.get("step_timeout_s", 30.0),
    )
    chat = ChatTokens(tokenizer, settings.get("system_prompt", ""))
    runner = EpisodeRunner(chat, make_env, limits, lambda room, key, turn: room, _Now())
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    loop = TurnLoop(generate, tokenizer, eos)
    episodes = runner.run(loop, rows, list(range(len(rows))), 1)
    return episodes, loop


def episode_stats(episodes: list[Any]) -> dict[str, float]:
    from actors.agents.episodes import episode_summary

    dropped, counts = episode_summary(episodes)
    rewards = [float(sum(ep.rewards)) for ep in episodes]
    return {
        "episodes": len(episodes),
        "dropped": sum(dropped.values()),
        "turns_mean": counts["turns"] / max(counts.get("kept", 0), 1),
        "win_rate": sum(r > 0 for r in rewards) / max(len(rewards), 1),
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "action_tokens_mean": statistics.fmean(sum(ep.action) for ep in episodes) if episodes else 0.0,
    }


# -- TRL -------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="JSON from vs_trl_agents.py: settings and per-step game rows")
    ap.add_argument("--model", required=True, help="transformers folder of the policy")
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", default="", help="save the trained policy here (safetensors)")
    ap.add_argument("--mode", default="rollout_func", choices=["rollout_func", "environment_factory"])
    ap.add_argument(
        "--chat-template", default="", help="environment_factory: a jinja file replacing the model's template"
    )
    ap.add_argument("--steps", type=int, default=0, help="train only the first N steps of the file (0: all)")
    ap.add_argument("--vllm", default="", choices=["", "colocate"], help="TRL's vLLM generation (probe; needs vllm)")
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(args.prompts).read_text())
    s = spec["settings"]
    steps = spec["steps"][: args.steps] if args.steps else spec["steps"]
    rows = [r for step in steps for r in step]  # one step's games after another
    torch.manual_seed(s["seed"])
    per_step = s["prompts_per_step"] * s["samples_per_prompt"]

    # The game's row travels inside the user message (`row_index`): TRL hands rollout_func the
    # prompts only, and every game's prompt text is the same (the target is not in it).
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"], "row_index": i}], "row_index": i}
            for i, r in enumerate(rows)
        ]
    )
    env_mode = args.mode == "environment_factory"
    config = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix("")) + "_trainer",
        max_steps=len(steps),
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        num_generations=s["samples_per_prompt"],
        # rollout_func: TRL's generate call makes one turn (the episode's limits are rayrlhf's).
        # environment_factory: TRL's budget for the whole multi-turn completion (replies and tool
        # results), each turn at most max_new_tokens (generation_kwargs), turns = tool iterations + 1.
        max_completion_length=(s["episode_max_tokens"] - s["max_prompt_tokens"]) if env_mode else s["max_new_tokens"],
        generation_kwargs={"max_new_tokens": s["max_new_tokens"]} if env_mode else None,
        max_tool_calling_iterations=s["max_turns"] - 1 if env_mode else None,
        temperature=s["temperature"],
        top_p=s["top_p"],
        learning_rate=s["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=s["max_grad_norm"],
        beta=0.0,
        epsilon=s["clip_eps"],
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        bf16=s.get("bf16", True),
        gradient_checkpointing=False,
        use_cpu=True,
        use_vllm=bool(args.vllm),
        vllm_mode=args.vllm or "colocate",
        vllm_max_model_length=s["episode_max_tokens"] + 8 if args.vllm else None,
        vllm_enable_sleep_mode=False,
        shuffle_dataset=False,
        seed=s["seed"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    rollout_stats: list[dict] = []

    def rollout(prompts: list, trainer: Any) -> dict:
        """TRL's rollout_func: the batch's episodes, each turn generated by TRL's generation path."""
        t0 = time.perf_counter()
        picked = [rows[p[-1]["row_index"]] for p in prompts]

        def generate(prompt_ids: list[list[int]], rooms: list[int]):
            ids, lps = trainer._generate_single_turn(prompt_ids, None, {}, 1)
            return list(zip(ids, lps if lps is not None else [None] * len(ids)))

        episodes, loop = play(picked, generate, tok, s)
        rollout_stats.append(
            {
                **episode_stats(episodes),
                "rollout_s": time.perf_counter() - t0,
                "generate_s": loop.generate_s,
                "turn_batches": loop.turn_batches,
            }
        )
        return {
            "prompt_ids": [ep.prompt_ids for ep in episodes],
            "completion_ids": [ep.ids for ep in episodes],
            "logprobs": [ep.logprobs for ep in episodes] if trainer.use_vllm else None,
            "env_mask": [[int(a) for a in ep.action] for ep in episodes],  # observations: context only
            "episode_reward": [float(sum(ep.rewards)) for ep in episodes],
        }

    def episode_reward(prompts, completions, episode_reward, **_):
        return [float(r) for r in episode_reward]

    kwargs: dict[str, Any]
    if env_mode:
        from actors.agents.environments import GuessNumber

        if args.chat_template:
            tok.chat_template = Path(args.chat_template).read_text()
        game_args = dict(s["env_args"])

        class GuessGame:
            """rayrlhf's GuessNumber as a TRL tool environment."""

            def __init__(self) -> None:
                self.game, self.reward, self.done = GuessNumber(**game_args), 0.0, False

            def reset(self, row_index: int, **_: Any) -> None:
                self.game.reset(rows[row_index])
                self.reward, self.done = 0.0, False

            def guess(self, number: int) -> str:
                """Guess the secret number.

                Args:
                    number: The whole number you guess.

                Returns:
                    "Higher." or "Lower." when wrong, "Correct." when right.
                """
                if self.done:
                    return "The game is over."
                step = self.game.step(str(number))
                self.reward += step.reward
                self.done = step.done
                return "Correct." if step.reward > 0 else (step.observation or "No guesses left.")

            def get_reward(self) -> float:
                return self.reward

        kwargs = {"environment_factory": GuessGame, "reward_funcs": None}
    else:
        kwargs = {"rollout_func": rollout, "reward_funcs": [episode_reward]}

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.t = time.perf_counter()
            self.rows: list[dict] = []

        def on_log(self, _args, state, _control, logs=None, **_kw):
            if logs and "reward" in logs:
                now = time.perf_counter()
                extra = rollout_stats[-1] if rollout_stats else {}
                self.rows.append(
                    {
                        "step": state.global_step,
                        "step_s": now - self.t,
                        **logs,
                        **{f"episode/{k}": v for k, v in extra.items()},
                    }
                )
                self.t = now
                print(
                    f"[trl] step {state.global_step}: {self.rows[-1]['step_s']:.1f}s reward {logs['reward']:.3f}"
                    + (f" turns {extra['turns_mean']:.2f} rollout {extra['rollout_s']:.1f}s" if extra else ""),
                    flush=True,
                )

    if args.vllm == "colocate":
        use_reload_weights()
    timer = StepTimes()
    trainer = GRPOTrainer(
        model=model, processing_class=tok, args=config, train_dataset=dataset, callbacks=[timer], **kwargs
    )
    t0 = time.perf_counter()
    timer.t = t0
    trainer.train()
    wall = time.perf_counter() - t0
    if args.save:
        trainer.model.save_pretrained(args.save, safe_serialization=True)
        tok.save_pretrained(args.save)
    out = {
        "tool": "trl",
        "version": __import__("trl").__version__,
        "mode": args.mode,
        "generation": f"vllm_{args.vllm}" if args.vllm else "generate",
        **(sync_record() if args.vllm == "colocate" else {}),
        "threads": torch.get_num_threads(),
        "train_wall_s": wall,
        "steps": timer.rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1, default=float))
    print(f"[trl] {len(steps)} steps in {wall:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
