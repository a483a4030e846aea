"""Paired bootstrap: 95% intervals for measures computed over items, and for differences.

Quality is measured on a fixed set of items (held-out passages, task items, tool requests,
golden prompts); how much a number would move on another draw of items of the same kind is
estimated by resampling the items with replacement and recomputing the number. The resamples
are drawn once per pool of items (`Resampler.indices`, seeded from the pool's name) and used
for every variant, so two variants are always compared on the same draws: the interval of
their difference is that of the per-draw differences, which is far narrower than the two
marginal intervals together when the variants fail on the same items. The intervals are
percentile intervals over the resamples (order statistics, no interpolation, so infinite
replicates such as the perplexity of a broken model stay well defined). Equal seeds give
equal intervals: the report is reproducible.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

DEFAULT_RESAMPLES = 2000
DEFAULT_SEED = 0
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A two-sided interval [low, high] (95% unless stated)."""

    low: float
    high: float

    def excludes(self, value: float) -> bool:
        return value < self.low or value > self.high

    def to_list(self) -> list[float]:
        return [self.low, self.high]

    @classmethod
    def exact(cls, value: float) -> Interval:
        """The interval of a number measured without sampling error."""
        return cls(value, value)


@dataclass(frozen=True)
class Resampler:
    """The resamples of every pool of items: the same for equal (seed, pool, size)."""

    num_resamples: int = DEFAULT_RESAMPLES
    seed: int = DEFAULT_SEED

    def indices(self, pool: str, num_items: int) -> np.ndarray:
        """[num_resamples, num_items] indices into the pool, drawn with replacement."""
        if num_items < 1:
            raise ValueError(f"pool {pool!r} has no items to resample")
        rng = np.random.default_rng([self.seed, zlib.crc32(pool.encode())])
        return rng.integers(0, num_items, size=(self.num_resamples, num_items))


def identity(num_items: int) -> np.ndarray:
    """[1, num_items] indices: the sample itself, for the point estimate."""
    return np.arange(num_items)[None, :]


def mean_over(values: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Per resample, the mean of the drawn items' values: [num_resamples]."""
    return np.asarray(values, dtype=np.float64)[indices].mean(axis=1)


def ratio_over(numerators: np.ndarray, denominators: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Per resample, sum of the drawn numerators / sum of the drawn denominators (a pooled
    share, e.g. nats per token over passages of different lengths): [num_resamples]."""
    num = np.asarray(numerators, dtype=np.float64)[indices].sum(axis=1)
    den = np.asarray(denominators, dtype=np.float64)[indices].sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def percentile_interval(replicates: np.ndarray, level: float = LEVEL) -> Interval:
    """The central `level` share of the replicates."""
    values = np.asarray(replicates, dtype=np.float64)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail], method="inverted_cdf")
    return Interval(float(low), float(high))


def paired_difference(a: np.ndarray, b: np.ndarray, level: float = LEVEL) -> Interval:
    """The interval of a - b, where replicate i of both came from the same resample i."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"unpaired replicates: {a.shape} and {b.shape}")
    return percentile_interval(a - b, level)
