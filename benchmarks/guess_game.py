"""The guessing game learnt two ways, side by side: multi-turn GRPO (``configs/grpo_guess_smollm2.yaml``)
and token-level Q-learning across turns (``configs/qlearn_guess_smollm2.yaml``; ``--qlearn-set``
tries a variant of it), each preset as shipped, with the same seeds, steps and held-out games. Each evaluation plays the 64 held-out games
greedily and 4 times each sampled at the rollout temperature with one seed at every evaluation
(``run.eval_sampled``): the sampled win rate on 256 episodes is the measure of a policy that acts by
sampling, as both train.

    .venv/bin/python benchmarks/guess_game.py [--seeds 0 1] [--steps 20] [--qlearn-set KEY=VALUE ...] [--out docs/results/guess_game.json]
    .venv/bin/python benchmarks/guess_game.py --collect grpo:0:runs/a qlearn:0:runs/b ...

``--collect`` reads finished runs instead (``ALGORITHM:SEED:RUN_DIR``, e.g. runs started by hand
with the same settings); each run's saved config must equal the preset's with this benchmark's
changes, or it is refused. Runs go one after another, so no two share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.preset_runs import summary, train  # noqa: E402

PRESETS = {"grpo": "grpo_guess_smollm2.yaml", "qlearn": "qlearn_guess_smollm2.yaml"}


def changes(algorithm: str, seed: int, a: argparse.Namespace) -> list[str]:
    """This benchmark's changes to a preset: seed, length, sampled evaluation, and ``--qlearn-set``'s."""
    extra = a.qlearn_set if algorithm == "qlearn" else []
    return [
        f"run.seed={seed}",
        f"run.steps={a.steps}",
        f"run.eval_every={a.eval_every}",
        "run.eval_sampled=true",
        *extra,
    ]


def check_settings(algorithm: str, run_dir: Path, seed: int, a: argparse.Namespace) -> None:
    """Refuses a collected run whose settings are not the preset's with this benchmark's changes
    (the saved config read as a config, so a field added since the run compares at its default)."""
    from cluster.config.loading import load_config

    want = load_config(ROOT / "configs" / PRESETS[algorithm], changes(algorithm, seed, a)).model_dump()
    got = load_config(run_dir / "config.yaml").model_dump()
    diff = [
        f"{section}.{key}"
        for section, fields in want.items()
        if isinstance(fields, dict)
        for key, value in fields.items()
        if key not in ("output_dir", "name") and got.get(section, {}).get(key) != value
    ]
    if diff:
        raise SystemExit(
            f"{run_dir}: settings differ from {PRESETS[algorithm]} + {changes(algorithm, seed, a)}: {diff}"
        )


def result(algorithm: str, seed: int, a: argparse.Namespace, figures: dict) -> dict:
    """A run's record: ``preset_runs``' figures (``train``'s or ``summary``'s) and the win rates' changes."""
    greedy, sampled = figures["eval_accuracy"], figures["eval_sampled_reward"]
    first, last = min(sampled), max(sampled)
    return {
        "algorithm": algorithm,
        "seed": seed,
        "preset": PRESETS[algorithm],
        "changes": changes(algorithm, seed, a),
        **figures,
        "sampled_gain": sampled[last] - sampled[first],
        "greedy_gain": greedy[last] - greedy[first],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--only", nargs="+", choices=list(PRESETS), default=list(PRESETS))
    ap.add_argument(
        "--qlearn-set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="changes to the Q-learning preset (a variant under trial)",
    )
    ap.add_argument("--collect", nargs="*", default=None, metavar="ALGORITHM:SEED:RUN_DIR")
    ap.add_argument("--runs", default=str(ROOT / "runs" / f"guess-game-{int(time.time())}"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "guess_game.json"))
    a = ap.parse_args()
    out: dict = {"steps": a.steps, "eval_every": a.eval_every, "runs": []}
    if a.collect is not None:
        for item in a.collect:
            algorithm, seed, run_dir = item.split(":", 2)
            check_settings(algorithm, Path(run_dir), int(seed), a)
            out["runs"].append(result(algorithm, int(seed), a, summary(Path(run_dir))))
    else:
        for seed in a.seeds:
            for algorithm in a.only:
                figures = train(
                    PRESETS[algorithm], Path(a.runs) / f"{algorithm}-seed{seed}", changes(algorithm, seed, a)
                )
                out["runs"].append(result(algorithm, seed, a, figures))
                Path(a.out).write_text(json.dumps(out, indent=1))  # each result kept as it comes
    Path(a.out).write_text(json.dumps(out, indent=1))
    for r in out["runs"]:
        print(
            f"{r['algorithm']} seed {r['seed']}: sampled win rate "
            + " -> ".join(f"{v:.3f}" for _, v in sorted(r["eval_sampled_reward"].items()))
            + f" ({r['sampled_gain']:+.3f}); greedy "
            + " -> ".join(f"{v:.3f}" for _, v in sorted(r["eval_accuracy"].items()))
            + f"; median step {r['median_step_s']:.1f} s"
        )


if __name__ == "__main__":
    main()
