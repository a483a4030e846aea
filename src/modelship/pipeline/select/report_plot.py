"""The report's plot: quality share of the base (y) against output tok/s under load (x),
one labelled point per measured variant, hand-drawn SVG (no plotting library needed).

Each point carries its 95% intervals as error bars: the quality share's bootstrap interval
vertically, the throughput's half-width from the serving rounds horizontally, so points
whose bars overlap are read as the tie they are scored as. The quality axis ends at 100%
(a share of the base never exceeds it) and a dashed line marks the quality gate.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from modelship.pipeline.select.scoring import VariantScore

WIDTH, HEIGHT, PAD = 520, 340, 56


@dataclass(frozen=True)
class PlotPoint:
    name: str
    throughput: float
    throughput_noise: float  # 95% half-width, 0 when unknown
    quality: float
    quality_low: float
    quality_high: float
    is_winner: bool
    passed: bool


def plot_points(
    scores: list[VariantScore], evaluations: dict[str, dict[str, Any]]
) -> list[PlotPoint]:
    points = []
    for score in scores:
        evaluation = evaluations[score.variant]
        serving = evaluation.get("serving") or {}
        x, y = serving.get("throughput_tok_s"), evaluation.get("quality_share")
        if x is None or y is None:
            continue
        low, high = evaluation.get("quality_share_ci95") or (y, y)
        noise = (serving.get("ci") or {}).get("throughput_tok_s") or 0.0
        points.append(
            PlotPoint(score.variant, x, noise, y, low, high, score is scores[0], score.passed)
        )
    return points


def plot_svg(
    scores: list[VariantScore], evaluations: dict[str, dict[str, Any]], quality_gate: float
) -> str:
    points = plot_points(scores, evaluations)
    if not points:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}"/>'
    x_lo = min(p.throughput - p.throughput_noise for p in points) * 0.9
    x_hi = max(p.throughput + p.throughput_noise for p in points) * 1.1 or 1.0
    y_lo = max(min(min(p.quality_low for p in points), quality_gate) - 0.02, 0.0)
    y_hi = 1.0

    def sx(v: float) -> float:
        return PAD + (v - x_lo) / max(x_hi - x_lo, 1e-9) * (WIDTH - 2 * PAD)

    def sy(v: float) -> float:
        return HEIGHT - PAD - (v - y_lo) / max(y_hi - y_lo, 1e-9) * (HEIGHT - 2 * PAD)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" '
        f'stroke="black"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 16}" text-anchor="middle">'
        f"output tok/s under load (95% interval)</text>",
        f'<text x="16" y="{HEIGHT / 2}" transform="rotate(-90 16 {HEIGHT / 2})" '
        f'text-anchor="middle">quality share of base (95% interval)</text>',
        f'<line class="gate" x1="{PAD}" y1="{sy(quality_gate):.1f}" x2="{WIDTH - PAD}" '
        f'y2="{sy(quality_gate):.1f}" stroke="#cf222e" stroke-dasharray="6 4"/>',
        f'<text x="{WIDTH - PAD}" y="{sy(quality_gate) - 4:.1f}" text-anchor="end" '
        f'fill="#cf222e">quality gate {quality_gate:.0%}</text>',
    ]
    for value in (x_lo, (x_lo + x_hi) / 2, x_hi):
        parts.append(
            f'<text x="{sx(value):.1f}" y="{HEIGHT - PAD + 16}" text-anchor="middle">'
            f"{value:.1f}</text>"
        )
    for value in (y_lo, (y_lo + y_hi) / 2, y_hi):
        parts.append(
            f'<text x="{PAD - 6}" y="{sy(value) + 4:.1f}" text-anchor="end">{value:.0%}</text>'
        )
    for p in points:
        color = "#1a7f37" if p.is_winner else ("#555555" if p.passed else "#cf222e")
        cx, cy = sx(p.throughput), sy(p.quality)
        bars = (
            (cx, sy(p.quality_low), cx, sy(p.quality_high)),
            (sx(p.throughput - p.throughput_noise), cy, sx(p.throughput + p.throughput_noise), cy),
        )
        for x1, y1, x2, y2 in bars:
            parts.append(
                f'<line class="error-bar" x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" '
                f'y2="{y2:.1f}" stroke="{color}"/>'
            )
        radius = 8 if p.is_winner else 5
        parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{radius}" fill="{color}"/>')
        suffix = " (winner)" if p.is_winner else "" if p.passed else " (gated)"
        label = html.escape(p.name + suffix)
        parts.append(f'<text x="{cx + 10:.1f}" y="{cy - 8:.1f}">{label}</text>')
    parts.append("</svg>")
    return "\n".join(parts)
