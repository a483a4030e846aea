"""The selection report as a reader gets it: report.md and report.html parsed back (every
table row has one cell per column), intervals on every quality number, the warning of a
variant that straddles a gate, the offending golden outputs, how scores are normalized,
and a plot with error bars, a quality axis ending at 100% and the gate marked."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

from markdown_it import MarkdownIt

from modelship.pipeline.select.bootstrap import Interval
from modelship.pipeline.select.report import write_report
from modelship.pipeline.select.scoring import (
    Gates,
    Ranking,
    VariantMeasurement,
    score_variants,
    weights_for,
)

LOOP = "the sea is blue and " * 12
CLEAN = {"repeated_ngrams": 0, "ngrams": 40, "printable_chars": 60, "chars": 60}


def evaluation(name: str, share: float, low: float, high: float, tput: float, looping=False):
    checks = [dict(CLEAN) for _ in range(4)]
    outputs = ["Paris.", "The ocean is wide.", "Red, green, blue.", "A machine."]
    if looping:
        checks[1] = {"repeated_ngrams": 30, "ngrams": 44, "printable_chars": 240, "chars": 240}
        outputs[1] = LOOP
    return {
        "variant": name,
        "quality": {
            "perplexity": 12.5,
            "top1_agreement": 0.93,
            "kl_divergence": 0.0123,
            "task_accuracy": 0.7,
            "tool_call_success": 0.6,
        },
        "quality_ci95": {"perplexity": [12.0, 13.1], "kl_divergence": [0.01, 0.015]},
        "quality_share": share,
        "quality_share_ci95": [low, high],
        "quality_share_differences": {
            "fp16": {"value": share - 1.0, "ci95": [low - 1.0, min(high - 1.0, 0.0)]}
        },
        "degeneration": {"repetition": {"value": 0.1, "ci95": [0.0, 0.5]}},
        "weight_bytes": 1e8,
        "serving": {
            "ttft_s": 0.05,
            "tpot_s": 0.02,
            "throughput_tok_s": tput,
            "ci": {"ttft_s": 0.002, "tpot_s": 0.001, "throughput_tok_s": tput * 0.04},
            "rounds": 3,
            "stopped": "converged",
            "golden_outputs": outputs,
            "golden_checks": checks,
            "golden": [{"prompt": f"prompt {i}"} for i in range(4)],
        },
    }


def measurement(data: dict, interval: Interval) -> VariantMeasurement:
    serving = data["serving"]
    metrics = {key: serving[key] for key in ("ttft_s", "tpot_s", "throughput_tok_s")}
    return VariantMeasurement(
        data["variant"],
        {"quality": data["quality_share"], "weight_bytes": data["weight_bytes"], **metrics},
        noise=serving["ci"],
        quality_interval=interval,
    )


def write(tmp_path: Path) -> Path:
    evaluations = {
        "base": evaluation("base", 1.0, 1.0, 1.0, 30.0),
        "fp16": evaluation("fp16", 1.0, 1.0, 1.0, 30.0),
        "gptq": evaluation("gptq", 0.895, 0.85, 0.94, 60.0),
        "awq|g32": evaluation("awq|g32", 0.96, 0.93, 0.99, 58.0, looping=True),
    }
    for name in ("base", "fp16"):
        del evaluations[name]["quality_share_differences"]
    del evaluations["base"]["quality_share"]
    measurements = [
        measurement(evaluations[name], Interval(*evaluations[name]["quality_share_ci95"]))
        for name in ("fp16", "gptq", "awq|g32")
    ]
    weights = weights_for(None)
    scores = score_variants(measurements, weights, Gates())
    write_report(tmp_path, "demo", 1, Ranking(scores, evaluations, weights, Gates()))
    return tmp_path


class _Tables(HTMLParser):
    """Each <table> as its rows, each row as its cells' text."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag, attrs) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag) -> None:
        if tag in ("td", "th") and self.cell is not None:
            self.tables[-1][-1].append("".join(self.cell).strip())
            self.cell = None

    def handle_data(self, data) -> None:
        if self.cell is not None:
            self.cell.append(data)


def parsed_tables(html: str) -> list[list[list[str]]]:
    parser = _Tables()
    parser.feed(html)
    return parser.tables


def test_every_table_row_has_one_cell_per_column_in_markdown_and_html(tmp_path: Path) -> None:
    folder = write(tmp_path)
    markdown = (folder / "report.md").read_text()
    for name, html in (
        ("report.md", MarkdownIt("commonmark").enable("table").render(markdown)),
        ("report.html", (folder / "report.html").read_text()),
    ):
        tables = parsed_tables(html)
        assert len(tables) == 3, name  # scores, metrics, quality against the base
        for table in tables:
            header, *rows = table
            assert rows, name
            for row in rows:
                assert len(row) == len(header), (name, header, row)
        quality = {row[0]: row[1:] for row in tables[2][1:]}
        assert tables[2][0] == ["measure", "base", "fp16", "awq|g32", "gptq"]
        assert quality["KL divergence from base, nats/token"][0] == "0.0123 [0.0100, 0.0150]"
        assert quality["quality share of base"][3] == "89.5% [85.0%, 94.0%]"
        assert quality["quality share minus fp16's (paired)"][3] == "-10.5% [-15.0%, -6.0%]"
    assert "||" not in markdown.replace("\\|", "")


def test_the_report_warns_explains_normalization_and_shows_degenerate_outputs(
    tmp_path: Path,
) -> None:
    markdown = (write(tmp_path) / "report.md").read_text()
    assert "**gptq** passed with a warning: quality 89.5% (95% interval 85.0%..94.0%)" in markdown
    assert "(q - 90%) / (100% - 90%)" in markdown and "q = 95.9% scores 0.59" in markdown
    assert "(max - v) / (max - min) where lower is better" in markdown
    offending = markdown.split("## Golden outputs past a degeneration gate on their own")[1]
    assert f"- awq|g32, 'prompt 1': 68% repeated 4-grams, 100% printable: {LOOP!r}" in offending
    assert "fp16," not in offending.split("##")[0]


def test_the_plot_has_error_bars_a_gate_line_and_stops_at_100_percent(tmp_path: Path) -> None:
    svg = (write(tmp_path) / "report.svg").read_text()
    assert svg.count('class="error-bar"') == 2 * 3  # quality and throughput, each variant
    assert 'class="gate"' in svg and "quality gate 90%" in svg
    percents = [int(p) for p in re.findall(r">(\d+)%</text>", svg)]
    assert max(percents) == 100
    [gate_y] = re.findall(r'class="gate" x1="[\d.]+" y1="([\d.]+)"', svg)
    top = re.search(r'text-anchor="end">100%</text>', svg)
    assert top is not None and float(gate_y) > 56  # below the top of the plot


def test_a_served_numerics_candidate_is_a_column_and_says_what_it_serves(tmp_path: Path) -> None:
    head = evaluation("gptq-int4head", 0.93, 0.9, 0.96, 64.0)
    head |= {"source_variant": "gptq", "engine": {"lm_head": "int4"}, "weight_bytes": 8e7}
    evaluations = {
        "base": evaluation("base", 1.0, 1.0, 1.0, 30.0),
        "gptq": evaluation("gptq", 0.95, 0.92, 0.98, 60.0),
        "gptq-int4head": head,
    }
    measurements = [
        measurement(evaluations[name], Interval(*evaluations[name]["quality_share_ci95"]))
        for name in ("gptq", "gptq-int4head")
    ]
    weights, gates = weights_for(None), Gates(min_quality_share=0.8)
    scores = score_variants(measurements, weights, gates)
    write_report(tmp_path, "demo", 1, Ranking(scores, evaluations, weights, gates))
    markdown = (tmp_path / "report.md").read_text()
    served = markdown.split("## Served numerics\n\n")[1].split("\n\n")[0]
    assert served == (
        "- gptq-int4head: gptq's weights served with --lm-head int4, measured like every "
        "variant (quality and serving)"
    )
    tables = parsed_tables((tmp_path / "report.html").read_text())
    assert tables[2][0] == ["measure", "base", *(s.variant for s in scores)]
    assert {row[0] for row in tables[0][1:]} == {"gptq", "gptq-int4head"}
