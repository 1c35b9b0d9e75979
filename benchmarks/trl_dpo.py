"""TRL's DPOTrainer on the exact workload rayrlhf runs in ``benchmarks/vs_trl_dpo.py``.

Runs in ``.venv-trl`` (``make trl-env``), so TRL's dependencies never touch the project's. Reads
the preference pairs in the order rayrlhf trains on them from ``--pairs`` and trains one pass
over them, ``pairs_per_step`` pairs per optimiser step, with the reference log-probs computed
once before training (``precompute_ref_log_probs``, as rayrlhf's Reference actor does).

    .venv-trl/bin/python benchmarks/trl_dpo.py --pairs P.json --model DIR --out R.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", required=True, help="JSON from vs_trl_dpo.py: settings and the pairs in training order")
    ap.add_argument("--model", required=True, help="transformers folder of the policy")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    spec = json.loads(Path(args.pairs).read_text())
    s = spec["settings"]
    torch.manual_seed(s["seed"])
    as_messages = lambda p: p if isinstance(p, list) else [{"role": "user", "content": p}]  # noqa: E731
    dataset = Dataset.from_list(
        [
            {
                "prompt": as_messages(r["prompt"]),
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in spec["pairs"]
        ]
    )
    config = DPOConfig(
        output_dir=str(Path(args.out).with_suffix("")) + "_trainer",
        max_steps=s["steps"],
        per_device_train_batch_size=s["pairs_per_step"],
        gradient_accumulation_steps=1,
        train_sampling_strategy="sequential",  # the pairs arrive in rayrlhf's order
        learning_rate=s["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=s["max_grad_norm"],
        beta=s["beta"],
        loss_type=["sigmoid"],
        max_length=s["max_length"],
        precompute_ref_log_probs=True,
        precompute_ref_batch_size=s["pairs_per_step"],
        # The fastest settings for this model on CPU: bf16 autocast over fp32 master weights where
        # the CPU computes bf16 natively, fp32 elsewhere (as rayrlhf decides it), no activation recomputation.
        bf16=s.get("bf16", True),
        gradient_checkpointing=False,
        use_cpu=True,
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

        def on_train_begin(self, *_a, **_kw):
            self.t = time.perf_counter()

        def on_log(self, _args, state, _control, logs=None, **_kw):
            if logs and "loss" in logs:
                now = time.perf_counter()
                self.rows.append({"step": state.global_step, "step_s": now - self.t, **logs})
                self.t = now

    timer = StepTimes()
    t0 = time.perf_counter()
    # TRL 1.16 computes the reference log-probs of the whole dataset in the constructor.
    trainer = DPOTrainer(model=model, processing_class=tok, args=config, train_dataset=dataset, callbacks=[timer])
    setup_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t1
    out = {
        "tool": "trl",
        "version": __import__("trl").__version__,
        "threads": torch.get_num_threads(),
        "setup_and_reference_s": setup_s,
        "train_s": train_s,
        "steps": timer.rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1, default=float))
    print(f"[trl] reference + setup {setup_s:.1f}s, {s['steps']} steps in {train_s:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
