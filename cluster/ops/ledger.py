"""The ledger of a run's units: what happened to every prompt (or preference pair, or
demonstration) drawn, so that a lost or repeated unit is visible and countable. The records
below say "prompt"; the ``units`` record names the run's kind of unit.

``<run dir>/ledger.jsonl`` is append-only, one JSON record per line:

* ``issued``   {step, uid, prompt, unit, version}: a prompt drawn and queued for the generator
  pool (``uid``: its position in the run's prompt stream, unique per draw and the same on resume;
  ``prompt``: its row in the dataset; ``unit``: its work unit in the step; ``version``: the
  policy version the generators held when it was issued);
* ``reissued`` {step, uid, generator, reason}: sent again after its generator died;
* ``scored``   {step, uid, samples, reward, generator, version[, resumed_turns]}: the prompt's
  samples that got a reward, their mean reward, the generator that sampled them and its policy
  version (``resumed_turns``: episode turns its samples took over from a run of their work unit
  that a generator's death interrupted, rather than sampling them again);
* ``dropped``  {step, uid, samples, all, reasons}: samples of the prompt left out before the loss
  (``all``: none of its samples was left; ``reasons``: the drop counts of the shard it was in,
  e.g. ``{"reward_error": 1}``);
* ``trained``  {step, uid, samples, version}: the prompt's samples were in the learners' update
  of ``step`` (``version``: the policy version after it);
* ``restart``  {step, role, detail}: a generator or the learners restarted;
* ``units``    {kind}: the first record: what a uid names (``prompt``, ``pair``, ``demonstration``,
  or ``transition``: offline Q-learning's replay draws, ``prompt`` holding the transition's row);
* ``resume``   {step}: the run resumed from its checkpoint of ``step``; records of later steps
  before it are void (the resumed run runs those steps again).

``summarize`` joins it all: a prompt is *lost* when it was issued in a finished step but neither
trained on nor dropped, and *trained twice* when two valid ``trained`` records name it.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

LEDGER_FILE = "ledger.jsonl"
EVENTS = ("units", "issued", "reissued", "scored", "dropped", "trained", "restart", "resume")
_COUNTED = ("issued", "reissued", "scored", "trained", "dropped")


class Ledger:
    """Appends a run's records; counts them for the metrics (``ledger/<event>``)."""

    def __init__(self, run_dir: Path, resume_step: int | None = None, unit: str = "prompt") -> None:
        self.path = Path(run_dir) / LEDGER_FILE
        self.counts: Counter[str] = Counter()
        if not self.path.is_file():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write([{"event": "units", "kind": unit}])
        elif resume_step is not None:
            self._write([{"event": "resume", "step": resume_step}])
            self.counts.update(r["event"] for r in valid_records(read_ledger(self.path)) if r["event"] in _COUNTED)

    def _write(self, records: Iterable[dict[str, Any]]) -> None:
        now = round(time.time(), 3)
        with self.path.open("a") as fh:
            for r in records:
                fh.write(json.dumps({**r, "t": now}) + "\n")

    def record(self, event: str, records: list[dict[str, Any]]) -> None:
        assert event in EVENTS, event
        self._write({"event": event, **r} for r in records)
        if event in _COUNTED:
            self.counts[event] += len(records)

    def metrics(self) -> dict[str, int]:
        """Records so far by event (cumulative; a resumed run continues the valid ones)."""
        return {f"ledger/{k}": int(self.counts[k]) for k in _COUNTED}


def read_ledger(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / LEDGER_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def valid_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records a ``resume`` did not void (those of steps after its checkpoint, written before it)."""
    out: list[dict[str, Any]] = []
    for r in records:
        if r["event"] == "resume":
            out = [x for x in out if x.get("step", 0) <= r["step"]]
        out.append(r)
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts over the valid records: prompts issued, trained, dropped, lost and trained twice."""
    valid = valid_records(records)
    issued = {r["uid"]: r["step"] for r in valid if r["event"] == "issued"}
    trained = Counter(r["uid"] for r in valid if r["event"] == "trained")
    dropped_all = {r["uid"] for r in valid if r["event"] == "dropped" and r.get("all")}
    finished = max((r["step"] for r in valid if r["event"] == "trained"), default=0)
    lost = sorted(u for u, step in issued.items() if step <= finished and u not in trained and u not in dropped_all)
    reasons: Counter[str] = Counter()
    for r in valid:
        if r["event"] == "dropped":
            reasons.update({k: int(v) for k, v in (r.get("reasons") or {"unknown": r.get("samples", 1)}).items()})

    kinds = [r["kind"] for r in records if r["event"] == "units"]
    return {
        "unit": kinds[0] if kinds else "prompt",
        "prompts": {
            "issued": len(issued),
            "reissued": sum(1 for r in valid if r["event"] == "reissued"),
            "scored": len({r["uid"] for r in valid if r["event"] == "scored"}),
            "trained": len(trained),
            "dropped": len(dropped_all),
            "lost": len(lost),
            "trained_twice": sum(1 for n in trained.values() if n > 1),
            "pending": sum(1 for step in issued.values() if step > finished),
        },
        "samples_dropped": dict(reasons),
        "lost_uids": lost[:20],
        "restarts": dict(Counter(r["role"] for r in valid if r["event"] == "restart")),
        "resumes": sum(1 for r in records if r["event"] == "resume"),
        "turns_resumed": sum(r.get("resumed_turns", 0) for r in valid if r["event"] == "scored"),
        "last_trained_step": finished,
    }


def issue_records(
    step: int, uids: list[int], prompt_ids: list[int], units: list[int], version: int | None
) -> list[dict]:
    """``issued`` records of one step (``units[i]``: the work unit of the i-th prompt)."""
    return [
        {"step": step, "uid": u, "prompt": p, "unit": k, "version": version} for u, p, k in zip(uids, prompt_ids, units)
    ]


def outcome_records(
    step: int, unit_uids: list[list[int]], gen_stats: list[dict], score_stats: list[dict], samples_per_prompt: int
) -> tuple[list[dict], list[dict], dict[int, int]]:
    """What became of one step's prompts between the generators and the loss: ``scored``
    records (the samples that got a reward, their mean), ``dropped`` records (samples missing
    after generation and scoring, with the unit's drop counts) and the samples of each prompt
    that reach the learners. ``unit_uids[i]`` are the uids of the work unit whose stats are
    ``gen_stats[i]`` and ``score_stats[i]``."""
    scored: list[dict] = []
    dropped: list[dict] = []
    kept: dict[int, int] = {}
    for uids, gen, score in zip(unit_uids, gen_stats, score_stats):
        groups = score.get("groups", gen.get("groups", []))
        rewards: dict[int, list[float]] = {}
        for g, r in zip(groups, score.get("scores", [])):
            rewards.setdefault(g, []).append(float(r))
        survivors = Counter(groups)
        # "truncated" counts samples that hit the length limit, which are kept.
        reasons = {k: int(v) for k, v in (score.get("skipped") or {}).items() if v and k != "truncated"}
        for u in uids:
            n = survivors.get(u, 0)
            if n:
                kept[u] = n
                got = rewards.get(u, [])
                scored.append(
                    {
                        "step": step,
                        "uid": u,
                        "samples": n,
                        "reward": round(sum(got) / len(got), 6) if got else None,
                        "generator": gen.get("generator"),
                        "version": gen.get("policy_version"),
                    }
                )
                resumed = sum(t for g, t in zip(gen.get("groups", []), gen.get("resumed_turns") or []) if g == u)
                if resumed:
                    scored[-1]["resumed_turns"] = resumed
            if n < samples_per_prompt:
                dropped.append(
                    {"step": step, "uid": u, "samples": samples_per_prompt - n, "all": n == 0, "reasons": reasons}
                )
    return scored, dropped, kept
