"""Preference pairs made by the generators (for the DPO recipe, ``dpo.pairs``):

    scorer      n candidates per prompt; reward.function ranks them (e.g. the task's verifier);
                the best and the worst form a pair when their scores differ
    self_judge  the same, ranked by the current model judging each candidate (Self-Rewarding
                Language Models, Yuan et al. 2024, sec. 2.3: k judgements averaged, additive
                5-point rubric; see ``actors/rewards/judge.py``)
    spin        the demonstration is chosen and the model's own reply to the same prompt is
                rejected (Self-Play Fine-Tuning, Chen et al. 2024, sec. 4)

Each source writes its pairs to ``<run dir>/data/pairs.parquet`` (prompt, chosen, rejected,
scores) and caches the encoded pairs, so a resumed run trains on exactly the same pairs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ray
import torch

from actors.data.offline_data import encode_pairs, write_preferences
from cluster.config import UserError
from cluster.run_context import RunContext
from cluster.data.prompts import PromptSampler
from learners.dpo import preference_pairs
from learners.experience import Experience

PAIRS_CACHE = "data/pairs.pt"
PAIRS_TABLE = "data/pairs.parquet"
PAIRS_COUNTS = "data/pairs_counts.json"


def cached_pairs(run_dir: Path) -> tuple[Experience, dict[str, float]] | None:
    """The pairs (and their counts) an earlier start of this run made, if any."""
    cache = run_dir / PAIRS_CACHE
    if not cache.is_file():
        return None
    counts = json.loads((run_dir / PAIRS_COUNTS).read_text()) if (run_dir / PAIRS_COUNTS).is_file() else {}
    return Experience(**torch.load(cache, weights_only=True)).validate(), counts


def _require_pairs(n: int, counts: dict[str, float]) -> None:
    if not n:
        raise UserError(
            f"no preference pair could be formed ({counts}); more dpo.pair_prompts or dpo.candidates, "
            "a smaller dpo.min_score_gap, or (self_judge) a judge.score_pattern the model's replies match"
        )


def _save(run_dir: Path, pairs: Experience, table: list[dict[str, Any]], counts: dict[str, float]) -> None:
    cache = run_dir / PAIRS_CACHE
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(pairs.fields(), cache)
    (run_dir / PAIRS_COUNTS).write_text(json.dumps(counts))
    write_preferences(run_dir / PAIRS_TABLE, table)


def prompt_stream(cfg: Any, n_rows: int) -> PromptSampler:
    """The prompts pairs are made from: one seeded stream per run, ``dpo.pair_prompts`` per draw.
    An iteration starts where the earlier iterations of its run stopped (``dpo.prompt_offset``,
    set by ``stages`` when ``dpo.fresh_prompts``), so each iteration draws new prompts."""
    return PromptSampler(n_rows, min(cfg.dpo.pair_prompts, n_rows), cfg.run.seed + 1, consumed=cfg.dpo.prompt_offset)


def ranked_pairs(ctx: RunContext, rollout: Any, rows: list[dict], by: str) -> tuple[Experience, dict[str, float]]:
    """Best vs worst of ``dpo.candidates`` samples of each of ``dpo.pair_prompts`` prompts
    (the generators' own tokens), ranked ``by`` 'scorer' or 'self_judge'. With
    ``dpo.target_pairs`` more prompts are drawn, ``dpo.pair_prompts`` at a time, until that many
    pairs formed or ``dpo.max_pair_prompts`` prompts were drawn (a shortfall is counted). A
    prompt gives no pair when fewer than two candidates have a score, when best - worst <=
    ``dpo.min_score_gap``, when best and worst are the same text, or when the best scores under
    ``dpo.min_chosen_score``; each case is counted."""
    cfg = ctx.cfg
    stream = prompt_stream(cfg, len(rows))
    target = cfg.dpo.target_pairs
    budget = cfg.dpo.max_pair_prompts or (4 * cfg.dpo.pair_prompts if target else cfg.dpo.pair_prompts)
    made: list[tuple[Experience, list[dict]]] = []
    counts: dict[str, float] = {}
    seconds, scores = 0.0, []
    while True:
        prompt_ids, uids = stream.next_with_uids()
        seed = cfg.run.seed * 100_003 + 7 * len(made)
        pairs, table, round_counts, secs, valid = _rank_round(ctx, rollout, rows, prompt_ids, uids, by, seed)
        made.append((pairs, table))
        for k, v in round_counts.items():
            counts[k] = counts.get(k, 0) + v
        seconds, scores = seconds + secs, scores + valid
        if not target or counts["pairs"] >= target or counts["prompts"] + cfg.dpo.pair_prompts > budget:
            break
    counts["draws"] = len(made)
    if target:
        counts["target_pairs"], counts["shortfall"] = target, max(0, target - counts["pairs"])
    if by == "self_judge":
        judged = counts.get("judge_judgements", 0)
        counts["judge_parse_rate"] = counts.get("judge_parsed", 0) / judged if judged else 0.0
    _require_pairs(int(counts["pairs"]), counts)
    pairs = Experience.concat([p for p, _ in made if p is not None], pad_token_id=0).validate()
    _save(ctx.dir, pairs, [r for _, t in made for r in t], counts)
    print(
        f"[rayrlhf] {int(counts['pairs'])} pairs from {int(counts['prompts'])} prompts x {cfg.dpo.candidates} "
        f"candidates ranked by {'the model as judge' if by == 'self_judge' else cfg.reward.function} (mean score "
        f"{sum(scores) / len(scores) if scores else float('nan'):.3f}; {counts}; skipped: {pairs.skipped}) "
        f"in {seconds:.0f}s -> {ctx.dir / PAIRS_TABLE}",
        flush=True,
    )
    return pairs, counts


def _best_and_worst(exp: Experience, dpo: Any, counts: dict) -> tuple[list[int], list[int], list[int]]:
    """Each group's best and worst scored candidate (rows) and the group, where they form a
    pair; the groups that form none are counted in ``counts`` by why."""
    best, worst, kept = [], [], []
    for g in dict.fromkeys(exp.group_ids.tolist()):
        members = [int(r) for r in (exp.group_ids == g).nonzero().flatten() if not math.isnan(float(exp.scores[r]))]
        if len(members) < 2:
            counts["no_pair_unscored"] += 1
            continue
        scores = exp.scores[members]
        b, w = members[int(scores.argmax())], members[int(scores.argmin())]
        if float(exp.scores[b] - exp.scores[w]) <= dpo.min_score_gap:
            counts["no_pair_tie"] += 1
        elif exp.completions[b] == exp.completions[w]:  # a noisy judge scored the same reply twice
            counts["no_pair_identical"] += 1
        elif float(exp.scores[b]) < dpo.min_chosen_score:
            counts["no_pair_low_score"] += 1
        else:
            best.append(b)
            worst.append(w)
            kept.append(g)
    return best, worst, kept


def _rank_round(
    ctx: RunContext, rollout: Any, rows: list[dict], prompt_ids: list[int], uids: list[int], by: str, seed: int
) -> tuple[Experience | None, list[dict], dict[str, float], float, list[float]]:
    """One draw of prompts: candidates, their scores, the pairs that form (group ids: the
    prompts' uids in the stream, unique across draws)."""
    cfg = ctx.cfg
    exp_refs, gen_stats = rollout.generate_checked([rows[i] for i in prompt_ids], uids, seed=seed)
    if by == "self_judge":
        exp_refs, score_stats = rollout.judge(exp_refs, seed=seed + 1)
    else:
        exp_refs, score_stats = rollout.score_checked(exp_refs)
    exp = Experience.concat(ray.get(exp_refs), pad_token_id=0)
    row_of = dict(zip(uids, prompt_ids))
    counts = {
        "prompts": len(uids),
        "candidates": exp.batch_size,
        "no_pair_tie": 0,
        "no_pair_unscored": 0,
        "no_pair_low_score": 0,
        "no_pair_identical": 0,
    }
    best, worst, kept = _best_and_worst(exp, cfg.dpo, counts)
    if by == "self_judge":
        for s in score_stats:
            for k, v in s["counts"].items():
                counts[f"judge_{k}"] = counts.get(f"judge_{k}", 0) + v
    counts["pairs"] = len(best)
    seconds = sum(s["seconds"] for s in gen_stats) + sum(s["seconds"] for s in score_stats)
    valid = exp.scores[~torch.isnan(exp.scores)].tolist()
    if not best:
        return None, [], counts, seconds, valid
    pairs = exp.select([r for pair in zip(best, worst) for r in pair]).trimmed()
    pairs = pairs.replace(scores=torch.tensor([1.0, 0.0] * len(best)), skipped=dict(exp.skipped)).validate()
    table = [
        {
            "prompt_id": row_of[g],
            "prompt": rows[row_of[g]]["prompt"],
            "chosen": exp.completions[b],
            "rejected": exp.completions[w],
            "score_chosen": float(exp.scores[b]),
            "score_rejected": float(exp.scores[w]),
            "source": by,
        }
        for g, b, w in zip(kept, best, worst)
    ]
    return pairs, table, counts, seconds, valid


def spin_pairs(ctx: RunContext, rollout: Any, tok: Any, demos: list[dict]) -> tuple[Experience, dict[str, float]]:
    """SPIN: for each of ``dpo.pair_prompts`` demonstrations, chosen = the demonstration's
    response, rejected = the current model's reply to its prompt (temperature
    ``dpo.candidate_temperature``). A reply equal to the demonstration gives no pair
    (``identical_pair``); multi-turn prompts are left out (``multi_turn_prompt``)."""
    cfg = ctx.cfg
    ids = prompt_stream(cfg, len(demos)).next()
    counts: dict[str, float] = {"prompts": len(ids), "multi_turn_prompt": 0, "identical_pair": 0}
    single = []
    for i in ids:
        msgs = demos[i]["prompt"]
        if len(msgs) == 1 and msgs[0]["role"] == "user":
            single.append(i)
        else:
            counts["multi_turn_prompt"] += 1
    exp_refs, stats = rollout.generate_texts(
        [demos[i]["prompt"][0]["content"] for i in single],
        single,
        n=1,
        temperature=cfg.dpo.candidate_temperature,
        seed=cfg.run.seed * 100_003,
    )
    exp = Experience.concat(ray.get(exp_refs), pad_token_id=0)
    rows = []
    for g, reply in zip(exp.group_ids.tolist(), exp.completions):
        demo = demos[g]
        if reply.strip() == demo["response"].strip():
            counts["identical_pair"] += 1
            continue
        rows.append({"prompt": demo["prompt"], "chosen": demo["response"], "rejected": reply, "index": g})
    _require_pairs(len(rows), counts)
    pairs, too_long = encode_pairs(
        rows,
        tok,
        max_prompt_tokens=cfg.model.max_prompt_tokens,
        max_response_tokens=cfg.model.max_new_tokens + 1,
        system_prompt=cfg.data.system_prompt,
    )
    counts["too_long"] = too_long.get("too_long", 0)
    counts["pairs"] = pairs.batch_size // 2
    pairs = pairs.replace(skipped={**exp.skipped, **too_long}).validate()
    _save(
        ctx.dir,
        pairs,
        counts=counts,
        table=[
            {
                "prompt_id": r["index"],
                "prompt": r["prompt"][0]["content"],
                "chosen": r["chosen"],
                "rejected": r["rejected"],
                "source": "spin",
            }
            for r in rows
        ],
    )
    seconds = sum(s["seconds"] for s in stats)
    print(
        f"[rayrlhf] {pairs.batch_size // 2} SPIN pairs (demonstration vs own reply) from {len(ids)} prompts "
        f"({counts}; skipped: {exp.skipped}) in {seconds:.0f}s -> {ctx.dir / PAIRS_TABLE}",
        flush=True,
    )
    return pairs, counts


def split_pairs(pairs: Experience, n_eval: int) -> tuple[Experience, Experience | None]:
    """The first ``n_eval`` pairs (at most a quarter) held out, the rest for training."""
    chosen, _, _ = preference_pairs(pairs.group_ids, pairs.scores)
    n = len(chosen)
    held = min(n_eval, n // 4)
    rows = lambda a, b: [r for i in range(a, b) for r in (2 * i, 2 * i + 1)]  # noqa: E731
    return pairs.select(rows(held, n)), (pairs.select(rows(0, held)) if held else None)
