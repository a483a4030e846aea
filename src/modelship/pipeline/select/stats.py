"""Repeated measurements: mean with a 95% confidence interval, and when two differ.

Serving numbers (TTFT, time per output token, throughput, peak RSS) vary from run to run on
a shared machine by more than the gap between two int4 variants on the same kernels, so
`select` measures each variant over several interleaved rounds and compares means with
their intervals. A difference counts only when it is both outside the noise (the two 95%
intervals do not overlap) and large enough to matter (`min_effect` of the larger value);
anything else is a tie. Non-overlap is stricter than a t-test of the difference on purpose:
two copies of the same weights must tie, and with three noisy metrics a 5% false-win rate
per metric would crown one of them every few runs.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; the normal's above.
_T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_quantile_975(degrees_of_freedom: int) -> float:
    if degrees_of_freedom < 1:
        raise ValueError("a confidence interval needs at least two samples")
    return _T_975[degrees_of_freedom - 1] if degrees_of_freedom <= len(_T_975) else 1.96


@dataclass(frozen=True)
class Estimate:
    """The mean of `n` samples and the half-width of its 95% confidence interval
    (inf for a single sample: one run says nothing about its own noise)."""

    mean: float
    half_width: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Estimate:
        if not samples:
            raise ValueError("no samples")
        mean = statistics.fmean(samples)
        if len(samples) < 2:
            return cls(mean, math.inf, 1)
        sem = statistics.stdev(samples) / math.sqrt(len(samples))
        return cls(mean, t_quantile_975(len(samples) - 1) * sem, len(samples))

    @property
    def relative_half_width(self) -> float:
        return self.half_width / abs(self.mean) if self.mean else math.inf

    def __str__(self) -> str:
        return f"{self.mean:.4g} +/- {self.half_width:.2g} (n={self.n})"


def differ(a: float, a_noise: float, b: float, b_noise: float, min_effect: float) -> bool:
    """Whether values a and b (each with its 95% half-width) are distinguishable: their
    intervals do not overlap and the gap is at least `min_effect` of the larger one."""
    gap = abs(a - b)
    return gap > a_noise + b_noise and gap >= min_effect * max(abs(a), abs(b))
