"""Policy objectives side by side on the GRPO preset (configs/grpo_smollm2.yaml: SmolLM2-135M,
basic_arithmetic, 8 prompts x 4 samples a step): GRPO, GSPO, CISPO and DAPO (clip-higher,
dynamic sampling with refill, overlong shaping), each from the same start with the same seed,
prompts and steps; held-out greedy accuracy on 128 prompts as the preset reports it, train reward,
response length and median step time. ``--critic`` adds PPO with the shared value head vs a
separate critic on the ``make train`` preset (configs/ppo_smollm2.yaml); ``--qlearn`` online
token-level Q-learning (configs/qlearn_smollm2.yaml) with Q as the raw logits (the earlier preset),
calibrated to the initial model (``qlearn.calibration=reference``) and calibrated with each
prompt's mean return taken off (``qlearn.reward_baseline=group_mean``, the preset): the sampled
policy's reward and response length per step.

    .venv/bin/python benchmarks/objectives.py [--steps 20] [--critic] [--qlearn] [--out docs/results/objectives.json]

Runs go one after another (``rayrlhf train`` each), so no two share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.preset_runs import train  # noqa: E402

# The settings each paper gives (ppo.* in cluster/config/schema.py says where they come from).
OBJECTIVES = {
    "grpo": [],
    "gspo": [
        "ppo.policy_loss=gspo",
        "ppo.clip_eps=0.0003",
        "ppo.clip_eps_high=0.0004",
        "ppo.loss_agg=seq_mean_token_mean",
    ],
    "cispo": ["ppo.policy_loss=cispo", "ppo.clip_eps=1.0", "ppo.clip_eps_high=0.28"],
    "dapo": [
        "ppo.clip_eps_high=0.28",
        "rollout.dynamic_sampling=8",
        "rollout.dynamic_sampling_max_draws=3",
        "ppo.overlong_buffer=12",
        "ppo.overlong_penalty=1.0",
    ],
}
CRITICS = {"shared": [], "separate": ["ppo.critic=separate"]}
# The Q-learning preset is calibrated, centered Q; "raw" is the earlier preset (the logits as Q,
# the floor term, one-step backups, lr 2e-6, a 1024-sequence buffer); "calibrated" and
# "calibrated_scale5" are the first calibrated trials (soft one-step backups, no centering).
RAW = [
    "qlearn.calibration=none",
    "qlearn.conservative=floor",
    "train.reference=actor",
    "train.lr=2e-6",
    "qlearn.n_step=1",
    "qlearn.reward_baseline=none",
    "qlearn.buffer_capacity=1024",
]
CALIBRATED = [
    "qlearn.calibration=reference",
    "qlearn.conservative=logsumexp",
    "train.reference=learners",
    "train.lr=2e-6",
    "qlearn.n_step=1",
    "qlearn.reward_baseline=none",
    "qlearn.buffer_capacity=1024",
]
QLEARN = {
    "raw": RAW,
    "calibrated": CALIBRATED,
    "calibrated_scale5": CALIBRATED + ["qlearn.reward_scale=5"],
    "centered": [],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--only", nargs="*", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    ap.add_argument("--critic", action="store_true", help="also PPO shared head vs separate critic (make train preset)")
    ap.add_argument(
        "--qlearn",
        nargs="*",
        choices=list(QLEARN),
        default=None,
        help="also online Q-learning: raw vs calibrated Q (no names: both)",
    )
    ap.add_argument("--runs", default=str(ROOT / "runs" / f"objectives-{int(time.time())}"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "objectives.json"))
    a = ap.parse_args()
    runs, common = Path(a.runs), [f"run.steps={a.steps}", f"run.eval_every={a.eval_every}"]
    out: dict = {"steps": a.steps, "preset": "grpo_smollm2.yaml", "objectives": {}, "critic": {}, "qlearn": {}}
    for name in a.only:
        out["objectives"][name] = train("grpo_smollm2.yaml", runs / name, common + OBJECTIVES[name])
        Path(a.out).write_text(json.dumps(out, indent=1))  # each result kept as it comes
    if a.critic:
        for name, sets in CRITICS.items():
            out["critic"][name] = train("ppo_smollm2.yaml", runs / f"critic-{name}", common + sets)
            Path(a.out).write_text(json.dumps(out, indent=1))
    if a.qlearn is not None:
        for name in a.qlearn or list(QLEARN):
            sets = QLEARN[name]
            out["qlearn"][name] = train("qlearn_smollm2.yaml", runs / f"qlearn-{name}", common + sets)
            Path(a.out).write_text(json.dumps(out, indent=1))
    for part in ("objectives", "critic", "qlearn"):
        for name, r in out[part].items():
            print(f"{part}/{name}: held-out {r['eval_accuracy']}, median step {r['median_step_s']:.1f} s")


if __name__ == "__main__":
    main()
