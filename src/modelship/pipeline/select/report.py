"""The selection report: why the winner won and why each other variant lost.

Written into the release as `report.md`, `report.html` and `report.svg` (quality share
against throughput with error bars and the gate, `report_plot.py`). Plain text, tables and
one hand-drawn SVG: the report must render anywhere without a plotting library.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

from modelship.pipeline.select.report_plot import plot_svg
from modelship.pipeline.select.scoring import METRICS, Gates, Ranking, VariantScore, tie_at_top

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


def _with_interval(value: float, interval: list[float] | None, style: str) -> str:
    """A bootstrap-measured value with its 95% interval (not symmetric, so both ends)."""
    if interval is None:
        return style.format(value)
    low, high = interval
    return f"{style.format(value)} [{style.format(low)}, {style.format(high)}]"


def explain(scores: list[VariantScore], weights: dict[str, float]) -> list[str]:
    """One sentence per variant: the winner's edge, each loser's gap or gate."""
    winner = scores[0]
    lines = [
        f"**{winner.variant}** won with score {winner.score:.3f} "
        f"({_contributions(winner, weights)})."
    ]
    lines += _warnings(winner)
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
        lines += _warnings(score)
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


def _warnings(score: VariantScore) -> list[str]:
    return [f"**{score.variant}** passed with a warning: {text}." for text in score.warnings]


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
            raw = _raw(evaluation, metric)
            if metric == "quality" and raw is not None:
                value = _with_interval(raw, evaluation.get("quality_share_ci95"), "{:.1%}")
            else:
                value = _fmt(metric, raw, _half_width(evaluation, metric))
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


def numerics_lines(names: list[str], evaluations: dict[str, dict[str, Any]]) -> list[str]:
    """One line per served-numerics candidate: whose weights, served with which options
    (on top of pipeline.yaml's `serve.engine`; a release of it serves the same)."""
    lines = []
    for name in names:
        evaluation = evaluations[name]
        engine = evaluation.get("engine")
        if engine:
            flags = [f"--{key.replace('_', '-')} {value}" for key, value in engine.items()]
            options = ", ".join(flags)
            lines.append(
                f"- {name}: {evaluation.get('source_variant', name)}'s weights served with "
                f"{options}, measured like every variant (quality and serving)"
            )
    return lines


def quality_rows(names: list[str], evaluations: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Every quality measure per variant with its 95% bootstrap interval, the quality
    share's paired difference from the first variant (the winner), and the golden
    prompts' degeneration shares."""
    fields = [
        ("perplexity (held-out)", "perplexity", "{:.2f}"),
        ("top-1 agreement with base", "top1_agreement", "{:.1%}"),
        ("KL divergence from base, nats/token", "kl_divergence", "{:.4f}"),
        ("task accuracy", "task_accuracy", "{:.1%}"),
        ("tool-call success", "tool_call_success", "{:.1%}"),
    ]
    rows = []
    for label, key, style in fields:
        cells = [label]
        for name in names:
            evaluation = evaluations[name]
            value = (evaluation.get("quality") or {}).get(key)
            interval = (evaluation.get("quality_ci95") or {}).get(key)
            cells.append("-" if value is None else _with_interval(value, interval, style))
        rows.append(cells)
    share_row, difference_row = ["quality share of base"], []
    reference = next((n for n in names if "quality_share" in evaluations[n]), None)
    if reference is not None:
        difference_row = [f"quality share minus {reference}'s (paired)"]
    for name in names:
        evaluation = evaluations[name]
        share = evaluation.get("quality_share")
        share_row.append(
            "-"
            if share is None
            else _with_interval(share, evaluation.get("quality_share_ci95"), "{:.1%}")
        )
        if difference_row:
            difference = (evaluation.get("quality_share_differences") or {}).get(reference)
            difference_row.append(
                "-"
                if difference is None
                else _with_interval(difference["value"], difference["ci95"], "{:+.1%}")
            )
    rows += [share_row] + ([difference_row] if difference_row else [])
    for label, key in (
        ("repeated 4-grams, all golden prompts", "repetition"),
        ("printable characters, all golden prompts", "printable"),
    ):
        cells = [label]
        for name in names:
            measured = (evaluations[name].get("degeneration") or {}).get(key)
            cells.append(
                "-"
                if measured is None
                else _with_interval(measured["value"], measured["ci95"], "{:.1%}")
            )
        rows.append(cells)
    return rows


def offending_outputs(
    names: list[str], evaluations: dict[str, dict[str, Any]], gates: Gates
) -> list[str]:
    """One line per golden output past a degeneration gate on its own: the variant, the
    prompt, its shares and the output itself."""
    lines = []
    for name in names:
        serving = evaluations[name].get("serving") or {}
        outputs = serving.get("golden_outputs") or []
        for check, answer, text in zip(
            serving.get("golden_checks") or [], serving.get("golden") or [], outputs, strict=False
        ):
            repetition = check["repeated_ngrams"] / check["ngrams"] if check["ngrams"] else 0.0
            printable = check["printable_chars"] / check["chars"] if check["chars"] else 0.0
            if repetition <= gates.max_repetition and printable >= gates.min_printable:
                continue
            shown = text if len(text) <= 300 else text[:300] + "..."
            lines.append(
                f"- {name}, {answer['prompt']!r}: {repetition:.0%} repeated 4-grams, "
                f"{printable:.0%} printable: {shown!r}"
            )
    return lines


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A pipe table; a pipe inside a cell is escaped (`\\|`), as Markdown reads it."""

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *(line(row) for row in rows)])


def normalization_note(weights: dict[str, float], gates: Gates) -> str:
    """How a score is computed (`scoring.score_variants`), in one paragraph with formulas."""
    gate = gates.min_quality_share
    example = min(gate + (1 - gate) * 0.59, 1.0)
    weights_text = " + ".join(f"{w:.2f} x {g}" for g, w in sorted(weights.items()))
    return (
        "How scores are computed: each metric is normalized to 0..1 among the variants that "
        f"passed the gates. Quality share q is on a fixed scale anchored at the gate: "
        f"(q - {gate:.0%}) / (100% - {gate:.0%}), clipped to 0..1, so the gate scores 0 and "
        f"the base's quality 1 (q = {example:.1%} scores 0.59). Every other metric v is "
        "min-max scaled across those variants: (v - min) / (max - min) where higher is "
        "better (throughput), (max - v) / (max - min) where lower is better (TTFT, time per "
        "output token, weight bytes, peak RSS); all 1 when they are equal or only one variant "
        "passed. So the whole spread among survivors is worth a metric's full weight, however "
        "small it is, while quality is priced by its distance from the gate. A variant tied "
        "within noise with a better one (serving: 95% intervals overlap or the gap is under "
        "the minimum effect; quality: the paired interval of the difference holds 0) scores "
        "as that one. A group (quality, latency, throughput, memory) scores the mean of its "
        f"metrics, and the score is the weighted sum: {weights_text}."
    )


def write_report(folder: Path, slug: str, release: int, ranking: Ranking) -> None:
    scores, evaluations = ranking.scores, ranking.evaluations
    weights, gates = ranking.weights, ranking.gates
    names = [s.variant for s in scores]
    header = ["metric (mean +/- 95% CI or [95% interval], normalized 0..1)", *names]
    weight_text = ", ".join(f"{g} {w:.2f}" for g, w in weights.items())
    gate_text = (
        f"loads and serves; quality share >= {gates.min_quality_share:.0%}; repeated 4-grams "
        f"over all golden prompts <= {gates.max_repetition:.0%}; printable output >= "
        f"{gates.min_printable:.0%}. A gate fails a variant only when the whole 95% interval "
        "lies past it; an interval that straddles it passes with a warning"
    )
    sections = [
        f"# Selection report: {slug}, release {release}",
        "\n".join(f"- {line}" for line in explain(scores, weights)),
        f"Weights: {weight_text}. Gates: {gate_text}.",
        normalization_note(weights, gates),
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
        *(
            ["## Served numerics\n\n" + "\n".join(numerics)]
            if (numerics := numerics_lines(names, evaluations))
            else []
        ),
        "## Quality against the base model\n\n"
        + _markdown_table(["measure", "base", *names], quality_rows(["base", *names], evaluations)),
        "## Quality against throughput\n\n![quality against throughput](report.svg)",
        "Provenance (source and checksums, recipes, tool versions, measurements with intervals, "
        "gate results; `modelship release show` adds the canary history): "
        "[provenance.json](provenance.json)",
    ]
    offending = offending_outputs(names, evaluations, gates)
    if offending:
        sections.append(
            "## Golden outputs past a degeneration gate on their own\n\n"
            "The gates read the shares over all golden prompts together (with their "
            "intervals); these single outputs were past a gate by themselves.\n\n"
            + "\n".join(offending)
        )
    golden = [
        f"- {name}: {evaluations[name]['serving']['golden_outputs'][0]!r}"
        for name in names
        if evaluations[name].get("serving")
    ]
    if golden:
        sections.append("## First golden prompt, greedy\n\n" + "\n".join(golden))
    markdown = "\n\n".join(sections) + "\n"
    svg = plot_svg(scores, evaluations, gates.min_quality_share)
    (folder / "report.md").write_text(markdown)
    (folder / "report.svg").write_text(svg)
    (folder / "report.html").write_text(_html(markdown, svg, slug, release))


_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s\"]+)\)")
_CELL_BORDER = re.compile(r"(?<!\\)\|")  # a pipe that is not escaped


def table_cells(line: str) -> list[str]:
    """The cells of one Markdown table row, escaped pipes restored."""
    inner = line.strip()[1:-1]
    return [cell.strip().replace("\\|", "|") for cell in _CELL_BORDER.split(inner)]


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
            cells = table_cells(line)
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
