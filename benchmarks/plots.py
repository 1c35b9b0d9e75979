"""PNG plots of the benchmark results in ``docs/results/*.json`` (next to each JSON file).

    .venv/bin/python benchmarks/plots.py [--results docs/results]

``vs_trl.py`` draws its own plot; this script draws the rollout, weight-sync and memory ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def rollout(path: Path) -> Path:
    plt = _plt()
    res = json.loads(path.read_text())
    names = [
        ("hf_generate", "transformers generate"),
        ("bare_vllm", "bare vLLM"),
        ("generator", "Generator class"),
        ("generator_actor", "Generator Ray actor"),
        ("pool_total", "2-actor pool (1 thread each)"),
    ]
    names = [(k, label) for k, label in names if any(k in r["best_tokens_per_s"] for r in res["rows"])]  # measured ones
    batches = [r["batch"] for r in res["rows"]]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(names)
    for i, (key, label) in enumerate(names):
        vals = [r["best_tokens_per_s"].get(key, 0) for r in res["rows"]]
        ax.bar([j + i * width for j in range(len(batches))], vals, width, label=label)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Rollout, SmolLM2-135M {res['dtype']}, {res['new_tokens']} new tokens, {res['cpus']} CPUs")
    ax.legend(fontsize=8)
    return _save(fig, path)


def weight_sync(path: Path) -> Path:
    plt = _plt()
    res = json.loads(path.read_text())
    labels = {
        "raw_copy_s": "raw copy (floor)",
        "pack_s": "pack to flat bf16",
        "pack_reused_s": "pack, reused buffer",
        "object_store_flat_s": "object store, flat",
        "object_store_dict_s": "object store, dict",
        "vllm_load_inside_actor_s": "vLLM reload in actor",
        "sync_end_to_end_s": "whole sync, object store",
        "collective_end_to_end_s": "whole sync, collective",
    }
    keys = [k for k in labels if k in res]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([labels[k] for k in keys], [statistics.median(res[k]) * 1e3 for k in keys])
    ax.invert_yaxis()
    ax.set_xlabel("ms (median)")
    ax.set_title(f"Weight sync, SmolLM2-135M ({res['bytes_bf16'] / 1e6:.0f} MB bf16)")
    return _save(fig, path)


def learner_memory(path: Path) -> Path:
    plt = _plt()
    res = json.loads(path.read_text())
    fig, (a, b) = plt.subplots(1, 2, figsize=(7, 3.2))
    summary = (
        res["summary"]
        if isinstance(res, dict)
        else {r["mode"]: {"peak_rss_gb": r["peak_rss_gb"], "median_step_s": min(r["step_s"])} for r in res}
    )
    modes = list(summary)
    a.bar(modes, [summary[m]["peak_rss_gb"] for m in modes])
    a.set_ylabel("peak RSS (GB)")
    b.bar(modes, [summary[m]["median_step_s"] for m in modes])
    b.set_ylabel("learner step (s)")
    fig.suptitle("Learner, SmolLM2-135M: full, full with fused log-probs, LoRA")
    return _save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(ROOT / "docs" / "results"))
    d = Path(ap.parse_args().results)
    for name, fn in (
        ("rollout.json", rollout),
        ("weight_sync.json", weight_sync),
        ("learner_memory.json", learner_memory),
    ):
        if (d / name).exists():
            print(f"wrote {fn(d / name)}")


if __name__ == "__main__":
    main()
