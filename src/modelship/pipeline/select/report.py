"""The selection report: why the winner won and why each other variant lost.

Written into the release as `report.md`, `report.html` and `report.svg` (quality share
against throughput, the winner marked). Plain text, tables and one hand-drawn SVG: the
report must render anywhere without a plotting library.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

from modelship.pipeline.select.scoring import METRICS, Ranking, VariantScore, tie_at_top

# metric -> (label, format of the raw value)
_LABELS = {
    "quality": ("quality share of base", "{:.1%}"),
    "ttft_s": ("TTFT p50 (ms), concurrency 1", "ms"),
    "tpot_s": ("time per output token (ms)", "ms"),
    "throughput_tok_s": ("output tok/s under load", "{:.1f}"),
    "weight_bytes": ("resident weights (MB)", "MB"),
    "peak_rss_bytes": ("peak RSS of the replica (MB)", "MB"),
}


def _fmt(metric: str, value: float | None, half_width: float | None = None) -> str:
    """The value in its unit, with its 95% half-width where it was measured in rounds."""
    if value is None:
        return "-"
    style = _LABELS[metric][1]
    scale = {"ms": 1e3, "MB": 1e-6}.get(style)
    if scale is not None:
        text = f"{value * scale:.1f}"
        noise = None if half_width is None else f"{half_width * scale:.1f}"
    else:
        text = style.format(value)
        noise = None if half_width is None else style.format(half_width)
    return text if noise is None else f"{text} +/- {noise}"


def _raw(evaluation: dict[str, Any], metric: str) -> float | None:
    serving = evaluation.get("serving") or {}
    if metric == "quality":
        return evaluation.get("quality_share")
    if metric == "weight_bytes":
        return evaluation.get("weight_bytes")
    return serving.get(metric)


def _half_width(evaluation: dict[str, Any], metric: str) -> float | None:
    return ((evaluation.get("serving") or {}).get("ci") or {}).get(metric)


def explain(scores: list[VariantScore], weights: dict[str, float]) -> list[str]:
    """One sentence per variant: the winner's edge, each loser's gap or gate."""
    winner = scores[0]
    lines = [
        f"**{winner.variant}** won with score {winner.score:.3f} "
        f"({_contributions(winner, weights)})."
    ]
    tied, decided_by = tie_at_top(scores, weights)
    if tied:
        others = ", ".join(f"**{name}**" for name in tied[1:])
        how = (
            "equal on every group, so the name decided"
            if decided_by == "name"
            else f"broken by {decided_by}, the highest-weighted group where they differ"
        )
        lines.append(
            f"Tie within noise: **{winner.variant}** and {others} scored the same once "
            f"differences inside the 95% intervals are counted as none; {how}."
        )
    for score in scores[1:]:
        if not score.passed:
            lines.append(f"**{score.variant}** was gated out: {'; '.join(score.reasons)}.")
            continue
        gaps = {
            group: weights.get(group, 0.0)
            * (winner.group_scores.get(group, 0.0) - score.group_scores.get(group, 0.0))
            for group in weights
        }
        behind = sorted((g for g in gaps if gaps[g] > 1e-9), key=lambda g: -gaps[g])
        ahead = [g for g in gaps if gaps[g] < -1e-9]
        text = f"**{score.variant}** scored {score.score:.3f}, {winner.score - score.score:.3f} "
        text += "behind"
        if behind:
            text += ": it lost " + ", ".join(f"{gaps[g]:.3f} on {g}" for g in behind)
        if ahead:
            text += " and gained " + ", ".join(f"{-gaps[g]:.3f} on {g}" for g in ahead)
        lines.append(text + ".")
    return lines


def _contributions(score: VariantScore, weights: dict[str, float]) -> str:
    parts = [
        f"{group} {weights.get(group, 0.0):.2f} x {value:.2f}"
        for group, value in sorted(score.group_scores.items())
    ]
    return "weight x normalized score: " + ", ".join(parts)


def metric_rows(
    scores: list[VariantScore], evaluations: dict[str, dict[str, Any]]
) -> list[list[str]]:
    rows = []
    for metric in METRICS:
        cells = [_LABELS[metric][0]]
        for score in scores:
            evaluation = evaluations[score.variant]
            value = _fmt(metric, _raw(evaluation, metric), _half_width(evaluation, metric))
            normalized = score.normalized.get(metric)
            cells.append(value if normalized is None else f"{value} ({normalized:.2f})")
        rows.append(cells)
    return rows


def _rounds_note(scores: list[VariantScore], evaluations: dict[str, dict[str, Any]]) -> str:
    serving = [evaluations[s.variant].get("serving") for s in scores]
    measured = [x for x in serving if x and "rounds" in x]
    if not measured:
        return ""
    first = measured[0]
    return (
        f"Serving metrics: {first['rounds']} interleaved rounds (stopped: {first['stopped']}). "
        "Values whose 95% intervals overlap, or that differ by less than the minimum effect, "
        "score the same."
    )


def quality_rows(names: list[str], evaluations: dict[str, dict[str, Any]]) -> list[list[str]]:
    fields = [
        ("perplexity (held-out)", "perplexity", "{:.2f}"),
        ("top-1 agreement with base", "top1_agreement", "{:.1%}"),
        ("KL(base || variant), nats/token", "kl_divergence", "{:.4f}"),
        ("task accuracy", "task_accuracy", "{:.1%}"),
        ("tool-call success", "tool_call_success", "{:.1%}"),
    ]
    rows = []
    for label, key, style in fields:
        cells = [label]
        for name in names:
            value = (evaluations[name].get("quality") or {}).get(key)
            cells.append("-" if value is None else style.format(value))
        rows.append(cells)
    return rows


def plot_svg(scores: list[VariantScore], evaluations: dict[str, dict[str, Any]]) -> str:
    """Quality share (y) against throughput (x), one labelled point per measured variant."""
    points = []
    for score in scores:
        evaluation = evaluations[score.variant]
        x, y = _raw(evaluation, "throughput_tok_s"), evaluation.get("quality_share")
        if x is not None and y is not None:
            points.append((score.variant, x, y, score is scores[0], score.passed))
    width, height, pad = 520, 340, 56
    if not points:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"/>'
    xs = [p[1] for p in points]
    ys = [p[2] for p in points]
    x_lo, x_hi = min(xs) * 0.9, max(xs) * 1.1 or 1.0
    y_lo, y_hi = min(min(ys), 0.85) - 0.02, max(max(ys), 1.0) + 0.02

    def sx(v: float) -> float:
        return pad + (v - x_lo) / max(x_hi - x_lo, 1e-9) * (width - 2 * pad)

    def sy(v: float) -> float:
        return height - pad - (v - y_lo) / max(y_hi - y_lo, 1e-9) * (height - 2 * pad)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        f'stroke="black"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 16}" text-anchor="middle">'
        f"output tok/s under load</text>",
        f'<text x="16" y="{height / 2}" transform="rotate(-90 16 {height / 2})" '
        f'text-anchor="middle">quality share of base</text>',
    ]
    for value in (x_lo, (x_lo + x_hi) / 2, x_hi):
        parts.append(
            f'<text x="{sx(value):.1f}" y="{height - pad + 16}" text-anchor="middle">'
            f"{value:.1f}</text>"
        )
    for value in (y_lo, (y_lo + y_hi) / 2, y_hi):
        parts.append(
            f'<text x="{pad - 6}" y="{sy(value) + 4:.1f}" text-anchor="end">{value:.0%}</text>'
        )
    for name, x, y, is_winner, passed in points:
        color = "#1a7f37" if is_winner else ("#555555" if passed else "#cf222e")
        radius = 8 if is_winner else 5
        parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="{radius}" fill="{color}"/>')
        label = html.escape(name + (" (winner)" if is_winner else "" if passed else " (gated)"))
        parts.append(f'<text x="{sx(x) + 10:.1f}" y="{sy(y) - 8:.1f}">{label}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(folder: Path, slug: str, release: int, ranking: Ranking) -> None:
    scores, evaluations = ranking.scores, ranking.evaluations
    weights, gates = ranking.weights, ranking.gates
    names = [s.variant for s in scores]
    header = ["metric (mean +/- 95% CI, normalized 0..1)", *names]
    weight_text = ", ".join(f"{g} {w:.2f}" for g, w in weights.items())
    gate_text = (
        f"loads and serves; quality share >= {gates.min_quality_share:.0%}; repeated 4-grams "
        f"on golden prompts <= {gates.max_repetition:.0%}; printable output >= "
        f"{gates.min_printable:.0%}"
    )
    sections = [
        f"# Selection report: {slug}, release {release}",
        "\n".join(f"- {line}" for line in explain(scores, weights)),
        f"Weights: {weight_text}. Gates: {gate_text}.",
        "## Scores\n\n"
        + _markdown_table(
            ["variant", "passed", "score", *sorted(weights)],
            [
                [s.variant, "yes" if s.passed else "no", f"{s.score:.3f}"]
                + [f"{s.group_scores.get(g, 0.0):.2f}" for g in sorted(weights)]
                for s in scores
            ],
        ),
        "## Metrics\n\n"
        + _markdown_table(header, metric_rows(scores, evaluations))
        + "\n\n"
        + _rounds_note(scores, evaluations),
        "## Quality against the base model\n\n"
        + _markdown_table(["measure", "base", *names], quality_rows(["base", *names], evaluations)),
        "## Quality against throughput\n\n![quality against throughput](report.svg)",
        "Provenance (source and checksums, recipes, tool versions, measurements with intervals, "
        "gate results; `modelship release show` adds the canary history): "
        "[provenance.json](provenance.json)",
    ]
    golden = [
        f"- {name}: {evaluations[name]['serving']['golden_outputs'][0]!r}"
        for name in names
        if evaluations[name].get("serving")
    ]
    if golden:
        sections.append("## First golden prompt, greedy\n\n" + "\n".join(golden))
    markdown = "\n\n".join(sections) + "\n"
    svg = plot_svg(scores, evaluations)
    (folder / "report.md").write_text(markdown)
    (folder / "report.svg").write_text(svg)
    (folder / "report.html").write_text(_html(markdown, svg, slug, release))


_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s\"]+)\)")


def _html(markdown: str, svg: str, slug: str, release: int) -> str:
    """A small Markdown subset (headings, bullets, tables, bold) rendered to HTML."""
    body: list[str] = []
    table: list[list[str]] = []

    def inline(text: str) -> str:
        escaped = html.escape(text)
        while "**" in escaped:
            escaped = escaped.replace("**", "<b>", 1).replace("**", "</b>", 1)
        return _LINK.sub(r'<a href="\2">\1</a>', escaped)

    def flush_table() -> None:
        if table:
            head, *rest = table
            body.append("<table><tr>" + "".join(f"<th>{inline(c)}</th>" for c in head) + "</tr>")
            for row in rest:
                body.append("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in row) + "</tr>")
            body.append("</table>")
            table.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not all(set(c) <= {"-"} for c in cells):
                table.append(cells)
            continue
        flush_table()
        if line.startswith("![") and "report.svg" in line:
            body.append(svg)
        elif line.startswith("## "):
            body.append(f"<h2>{inline(line[3:])}</h2>")
        elif line.startswith("# "):
            body.append(f"<h1>{inline(line[2:])}</h1>")
        elif line.startswith("- "):
            body.append(f"<li>{inline(line[2:])}</li>")
        elif line.strip():
            body.append(f"<p>{inline(line)}</p>")
    flush_table()
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:2em auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}"
    )
    title = html.escape(f"modelship selection: {slug}, release {release}")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
