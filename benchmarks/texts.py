"""Real text for benchmarks that need passages: the prose paragraphs of docs/architecture.md."""

from __future__ import annotations

import re
from pathlib import Path

ARCHITECTURE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def architecture_paragraphs(min_chars: int) -> list[str]:
    """Paragraphs longer than `min_chars` (whitespace collapsed), tables, code and headings
    left out, in document order."""
    return [
        " ".join(p.split())
        for p in re.split(r"\n\s*\n", ARCHITECTURE.read_text())
        if len(p) > min_chars and not p.lstrip().startswith(("|", "```", "#"))
    ]
