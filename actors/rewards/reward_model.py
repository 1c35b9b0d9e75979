"""A trained reward model as a scorer: batched forward passes of a sequence-classification model
(a ``run.algorithm=reward_model`` checkpoint, or any ``*ForSequenceClassification`` folder with
one label) over the chat-formatted (prompt, response), exactly as its pairs were encoded in
training (``actors/data/offline_data.py``). Runs in its own actor; usable without Ray."""

from __future__ import annotations

import time
from typing import Any

import torch

from actors.data.offline_data import _prompt_ids, _reply_ids, pad_rows
from actors.rewards.scorer import TextScorer


class RewardModelScorer(TextScorer):
    def __init__(
        self,
        model_path: str,
        *,
        batch_size: int = 16,
        max_tokens: int = 1024,
        system_prompt: str = "",
        on_error: str = "skip",
        threads: int = 0,
        dtype: str = "float32",
    ) -> None:
        from transformers import AutoTokenizer

        from learners.reward_model import load_reward_model

        if threads:
            torch.set_num_threads(threads)
        self.model = load_reward_model(model_path, dtype=getattr(torch, dtype)).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{model_path} has {self.model.config.num_labels} labels; a reward model has one")
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.batch_size, self.max_tokens, self.system_prompt = batch_size, max_tokens, system_prompt
        self.on_error = on_error
        self.last_metrics = {}

    def encode(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        """The prompt's and the reply's token ids, as the reward model's pairs were encoded."""
        return (
            _prompt_ids(self.tok, [{"role": "user", "content": prompt}], self.system_prompt),
            _reply_ids(self.tok, completion),
        )

    @torch.no_grad()
    def rewards(self, rows: list[tuple[list[int], list[int]]]) -> tuple[list[float], int]:
        """The model's reward of each (prompt ids, reply ids) row, ``batch_size`` rows at a time
        (right-padded), and how many rows ran their prompt once for their group. Rows with the
        same prompt (a GRPO group's samples) are batched together and share that prompt, as the
        learner's pairs do (``learners/training/modeling.py: decoder_hidden``): the same rewards for fewer
        tokens."""
        from learners.reward_model import sequence_rewards

        prompt_group: dict[tuple[int, ...], int] = {}
        groups = [prompt_group.setdefault(tuple(p), len(prompt_group)) for p, _ in rows]
        order = sorted(range(len(rows)), key=lambda i: (groups[i], i))
        out, rows_shared = [0.0] * len(rows), 0
        for s in range(0, len(order), self.batch_size):
            idx = order[s : s + self.batch_size]
            ids, mask, reply = pad_rows([rows[i] for i in idx], self.pad_id)
            values, shared = sequence_rewards(self.model, ids, mask, reply, torch.tensor([groups[i] for i in idx]))
            rows_shared += len(idx) if shared else 0
            for i, v in zip(idx, values.tolist()):
                out[i] = v
        return out, rows_shared

    def score_texts(
        self, prompts: list[str], completions: list[str], meta: list[dict[str, Any]]
    ) -> tuple[list[float | None], dict[str, int]]:
        t0 = time.perf_counter()
        seqs = [self.encode(p, c) for p, c in zip(prompts, completions)]
        fits = [i for i, (p, c) in enumerate(seqs) if len(p) + len(c) <= self.max_tokens]
        values: list[float | None] = [None] * len(seqs)
        rewards, rows_shared = self.rewards([seqs[i] for i in fits])
        for i, r in zip(fits, rewards):
            values[i] = r
        counts = self._drop_or_raise(values, "reward_too_long", f"reward model (over {self.max_tokens} tokens)")
        self.last_metrics = {
            "scorer/rm_seconds": time.perf_counter() - t0,
            "scorer/rm_prompt_shared_frac": rows_shared / max(len(fits), 1),
        }
        return values, counts
