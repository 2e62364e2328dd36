"""Token selection from one row of logits: greedy, or temperature / top-k / top-p sampling.

Greedy (temperature <= 0) is a plain argmax so it agrees exactly with transformers'
greedy search. Sampling draws from a per-request numpy Generator, so a seed reproduces
the same tokens.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from vtool import VtoolError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature):
            raise VtoolError(f"temperature must be a finite number, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise VtoolError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise VtoolError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler:
    def __init__(self, config: SamplingConfig):
        self.config = config
        self.rng = np.random.default_rng(config.seed)

    def __call__(self, logits: np.ndarray) -> int:
        c = self.config
        if c.greedy:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / c.temperature
        if c.top_k > 0 and c.top_k < scaled.size:
            kth = np.partition(scaled, -c.top_k)[-c.top_k]
            scaled = np.where(scaled < kth, -np.inf, scaled)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if c.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = order[: int(np.searchsorted(cumulative, c.top_p) + 1)]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        return int(self.rng.choice(probs.size, p=probs))
