"""A trained reward model as a scorer: batched forward passes of a sequence-classification model
(a ``run.algorithm=reward_model`` checkpoint, or any ``*ForSequenceClassification`` folder with
one label) over the chat-formatted (prompt, response), exactly as its pairs were encoded in
training (``actors/offline_data.py``). Runs in its own actor; usable without Ray."""

from __future__ import annotations

import time
from typing import Any

import torch

from actors.offline_data import _prompt_ids, _reply_ids
from actors.scorer import TextScorer


class RewardModelScorer(TextScorer):
    def __init__(self, model_path: str, *, batch_size: int = 16, max_tokens: int = 1024, system_prompt: str = "",
                 on_error: str = "skip", threads: int = 0, dtype: str = "float32") -> None:
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

    def encode(self, prompt: str, completion: str) -> list[int]:
        return (_prompt_ids(self.tok, [{"role": "user", "content": prompt}], self.system_prompt)
                + _reply_ids(self.tok, completion))

    @torch.no_grad()
    def rewards(self, sequences: list[list[int]]) -> list[float]:
        """The model's reward of each token sequence, ``batch_size`` at a time (right-padded)."""
        from learners.reward_model import sequence_rewards

        out: list[float] = []
        for i in range(0, len(sequences), self.batch_size):
            chunk = sequences[i : i + self.batch_size]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.bool)
            for j, s in enumerate(chunk):
                ids[j, : len(s)] = torch.tensor(s)
                mask[j, : len(s)] = True
            out.extend(sequence_rewards(self.model, ids, mask).tolist())
        return out

    def score_texts(self, prompts: list[str], completions: list[str],
                    meta: list[dict[str, Any]]) -> tuple[list[float | None], dict[str, int]]:
        t0 = time.perf_counter()
        seqs = [self.encode(p, c) for p, c in zip(prompts, completions)]
        fits = [i for i, s in enumerate(seqs) if len(s) <= self.max_tokens]
        values: list[float | None] = [None] * len(seqs)
        for i, r in zip(fits, self.rewards([seqs[i] for i in fits])):
            values[i] = r
        counts = self._drop_or_raise(values, "reward_too_long", f"reward model (over {self.max_tokens} tokens)")
        self.last_metrics = {"scorer/rm_seconds": time.perf_counter() - t0}
        return values, counts
