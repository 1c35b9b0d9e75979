"""LLM-as-a-judge: a model grades (prompt, response) pairs on a point scale.

The default prompt is the additive 5-point rubric of "Self-Rewarding Language Models" (Yuan et
al. 2024, Fig. 2): one point per criterion met, the total written as ``Score: <n>``. Each item
is judged ``samples`` times at ``temperature`` and its score is the mean of the judgements
that parse and fall on the scale. Every judgement is counted as exactly one of

    parsed        a number matched ``score_pattern`` and lies in [min_score, max_score]
    unparsed      no match (an empty reply included)
    out_of_range  a number matched but lies off the scale (e.g. 11 on a 5-point scale)

so ``parsed + unparsed + out_of_range == judgements``. Items the judge never saw (their judge
prompt is over the token budget) are counted as ``items_too_long``; an item with no valid
judgement scores NaN and is left out by whoever uses the scores (pair building, rewards).

A plain class over any ``Generator``: the judge runs on the generator actors' vLLM engines,
batched, with the weights they hold (the current policy for self-rewarding), never on a
separate copy of the model.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

from actors.rewards.scorer import TextScorer

DEFAULT_TEMPLATE = """Review the user's question and the corresponding response using the additive 5-point \
scoring system described below. Points are accumulated based on the satisfaction of each criterion:

- Add 1 point if the response is relevant and provides some information related to the user's inquiry, \
even if it is incomplete or contains some irrelevant content.
- Add another point if the response addresses a substantial portion of the user's question, but does not \
completely resolve the query or provide a direct answer.
- Award a third point if the response answers the basic elements of the user's question in a useful way, \
regardless of whether it seems to have been written by an AI Assistant or if it has elements typically found \
in blogs or search results.
- Grant a fourth point if the response is clearly written from an AI Assistant's perspective, addressing the \
user's question directly and comprehensively, and is well-organized and helpful, even if there is slight room \
for improvement in clarity, conciseness or focus.
- Bestow a fifth point for a response that is impeccably tailored to the user's question by an AI Assistant, \
without extraneous information, reflecting expert knowledge, and demonstrating a high-quality, engaging, and \
insightful answer.

User: {prompt}

<response>{response}</response>

After examining the user's instruction and the response:
- Briefly justify your total score, up to 100 words.
- Conclude with the score using the format: "Score: <total points>"

Remember to assess from the AI Assistant perspective, utilizing web search knowledge as necessary. To \
evaluate the response in alignment with this additive scoring model, we'll systematically attribute points \
based on the outlined criteria."""

DEFAULT_PATTERN = r"Score:\s*(-?\d+(?:\.\d+)?)"

COUNTS = (
    "judgements",
    "parsed",
    "unparsed",
    "out_of_range",
    "items",
    "items_scored",
    "items_unscored",
    "items_too_long",
)


@dataclass
class JudgeConfig:
    """What a judge needs; ``cluster.config.JudgeSection`` documents each field for users."""

    # Judge prompt; ``{prompt}`` and ``{response}`` are replaced by the item's texts.
    template: str = DEFAULT_TEMPLATE
    # Regular expression whose first group is the score; the last match in a reply counts.
    score_pattern: str = DEFAULT_PATTERN
    # The scale: scores outside [min_score, max_score] are counted as out of range, not used.
    min_score: float = 0.0
    max_score: float = 5.0
    # Judgements per item (k) and their sampling temperature, nucleus and top-k (0: off).
    samples: int = 3
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    # ``module:function`` reading a reply's score (reply -> number or None) instead of the pattern.
    score_parser: str = ""
    # Token budgets of the judge prompt (after the chat template) and of its reply.
    max_prompt_tokens: int = 1024
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        missing = [v for v in ("{prompt}", "{response}") if v not in self.template]
        if missing:
            raise ValueError(f"judge template must contain {' and '.join(missing)}")
        try:
            compiled = re.compile(self.score_pattern)
        except re.error as e:
            raise ValueError(f"judge score_pattern is not a regular expression: {e}") from None
        if compiled.groups < 1:
            raise ValueError("judge score_pattern needs a capturing group around the number, e.g. 'Score: (\\d+)'")
        if not self.min_score < self.max_score:
            raise ValueError("judge min_score must be below max_score")
        if self.score_parser:
            resolve_parser(self.score_parser)

    def parse(self, reply: str) -> tuple[float | None, str]:
        """(score, 'parsed') or (None, 'unparsed' | 'out_of_range'), by the parser function or the pattern."""
        if self.score_parser:
            return parse_with(resolve_parser(self.score_parser), reply, self.min_score, self.max_score)
        return parse_score(reply, self.score_pattern, self.min_score, self.max_score)


@functools.lru_cache(maxsize=16)
def resolve_parser(spec: str) -> Any:
    """A ``module:function`` score parser; ValueError naming what is wrong."""
    from actors.imports import import_callable

    return import_callable(spec, "judge score_parser")


def parse_with(fn: Any, reply: str, min_score: float, max_score: float) -> tuple[float | None, str]:
    """A parser function's reading of a reply: an exception or a non-number is 'unparsed'."""
    try:
        value = fn(reply or "")
        value = None if value is None or isinstance(value, bool) else float(value)
    except Exception:  # a user's parser failing on one reply costs that judgement, counted
        return None, "unparsed"
    if value is None:
        return None, "unparsed"
    if not math.isfinite(value) or not min_score <= value <= max_score:
        return None, "out_of_range"
    return value, "parsed"


def judge_prompt(template: str, prompt: str, response: str) -> str:
    """The template with the item filled in (plain replacement: braces in the texts stay as they are)."""
    return template.replace("{prompt}", prompt).replace("{response}", response)


def parse_score(reply: str, pattern: str, min_score: float, max_score: float) -> tuple[float | None, str]:
    """(score, 'parsed') or (None, 'unparsed' | 'out_of_range'). The last match counts: a judge
    that restates the format before its verdict is still read right."""
    matches = re.findall(pattern, reply or "")
    if not matches:
        return None, "unparsed"
    last = matches[-1]
    text = last[0] if isinstance(last, tuple) else last
    try:
        value = float(text)
    except ValueError:
        return None, "unparsed"
    if not math.isfinite(value) or not min_score <= value <= max_score:
        return None, "out_of_range"
    return value, "parsed"


def aggregate(replies: list[list[str]], cfg: JudgeConfig) -> tuple[list[float], dict[str, int]]:
    """Mean valid score per item (NaN without one) and the counts of module doc; ``replies[i]``
    holds item i's judge replies (an empty list: the item was not judged)."""
    counts = dict.fromkeys(COUNTS, 0)
    scores = []
    for item in replies:
        valid = []
        for reply in item:
            value, status = cfg.parse(reply)
            counts[status] += 1
            if value is not None:
                valid.append(value)
        counts["judgements"] += len(item)
        scores.append(sum(valid) / len(valid) if valid else float("nan"))
    counts["items"] = len(replies)
    counts["items_scored"] = sum(1 for s in scores if not math.isnan(s))
    counts["items_unscored"] = counts["items"] - counts["items_scored"]
    return scores, counts


class Judge:
    """Scores (prompt, response) items with a generator's engine (see module doc)."""

    def __init__(self, cfg: JudgeConfig) -> None:
        self.cfg = cfg

    def judge(
        self, generator: Any, prompts: list[str], responses: list[str], seed: int | None = None
    ) -> tuple[list[float], dict[str, int], list[list[str]]]:
        """Returns per-item scores (NaN: no valid judgement), the counts, and the raw replies."""
        cfg = self.cfg
        if len(prompts) != len(responses):
            raise ValueError("prompts and responses must have the same length")
        replies: list[list[str]] = [[] for _ in prompts]
        texts = [judge_prompt(cfg.template, p, r) for p, r in zip(prompts, responses)]
        if texts:
            try:
                exp = generator.generate(
                    texts,
                    [{"item": i} for i in range(len(texts))],
                    list(range(len(texts))),
                    max_new_tokens=cfg.max_new_tokens,
                    max_prompt_tokens=cfg.max_prompt_tokens,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    top_k=cfg.top_k,
                    n=cfg.samples,
                    seed=seed,
                )
            except ValueError:  # every judge prompt was over the budget (or empty)
                exp = None
            if exp is not None:
                for m, text in zip(exp.meta, exp.completions):
                    replies[m["item"]].append(text)
        scores, counts = aggregate(replies, cfg)
        counts["items_too_long"] = sum(1 for r in replies if not r)
        return scores, counts, replies


def judge_demonstrations(
    task_rows: list[dict[str, Any]],
    n: int,
    template: str,
    seed: int = 0,
    max_score: float = 5.0,
    min_points: float = 1.0,
) -> list[dict[str, Any]]:
    """Evaluation fine-tuning (EFT) data, the second half of Self-Rewarding LMs' seed data
    (sec. 2.2): judge prompts with verdicts, so that a small model learns the judge's format
    before it judges. Built from task rows with known answers: half the items reply with the
    row's answer (``max_score``), half with another row's answer (``min_points``: relevant but
    wrong). Rows are demonstrations for ``encode_demonstrations``."""
    import random

    rng = random.Random(seed)
    rows = [r for r in task_rows if str(r.get("answer", "")).strip()]
    out: list[dict[str, Any]] = []
    if len(rows) < 2:
        return out
    for i in range(n):
        row = rows[i % len(rows)]
        correct = i % 2 == 0
        answer = str(row["answer"])
        if not correct:
            others = [str(r["answer"]) for r in rng.sample(rows, min(len(rows), 8)) if str(r["answer"]) != answer]
            if not others:
                continue
            answer = others[0]
        verdict = (
            "The response answers the question directly and correctly, with nothing extraneous."
            if correct
            else "The response is relevant to the question, but its answer is wrong."
        )
        score = max_score if correct else min_points
        out.append(
            {
                "prompt": [{"role": "user", "content": judge_prompt(template, row["prompt"], answer)}],
                "response": f"{verdict}\nScore: {score:g}",
                "index": i,
                "kind": "judge",
            }
        )
    return out


class JudgeScorer(TextScorer):
    """The judge as a reward (``reward.function=llm_judge`` with ``reward.model``): any causal-LM
    folder on its own vLLM engine grades each (prompt, response); an item without a valid
    judgement is dropped and counted as ``unjudged`` (or raises, per ``on_error``)."""

    def __init__(self, cfg: JudgeConfig, generator_config: Any, on_error: str = "skip", engine: Any = None) -> None:
        """``engine``: an already built generator (default: a new one from ``generator_config``)."""
        self.judge = Judge(cfg)
        if engine is None:
            from actors.rollout.generator import Generator

            engine = Generator(generator_config)
        self.gen = engine
        self.on_error = on_error
        self.last_metrics: dict[str, float] = {}
        self._calls = 0

    def score_texts(
        self, prompts: list[str], completions: list[str], meta: list[dict[str, Any]]
    ) -> tuple[list[float | None], dict[str, int]]:
        self._calls += 1
        scores, counts, _ = self.judge.judge(self.gen, prompts, completions, seed=self._calls)
        self.last_metrics = {f"judge/{k}": float(v) for k, v in counts.items()}
        values: list[float | None] = list(scores)
        return values, self._drop_or_raise(values, "unjudged", "LLM judge")
