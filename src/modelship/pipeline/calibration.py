"""Local text for calibration and evaluation: CPython's own English docs (`pydoc_data`).

The corpus is split deterministically: topics are sorted by name and every fifth one is
held out, so calibration never sees the evaluation text.
"""

from __future__ import annotations

import hashlib

HELD_OUT_EVERY = 5


def _topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return sorted(topics.items())


def _split(held_out: bool) -> list[str]:
    return [
        text
        for i, (_, text) in enumerate(_topics())
        if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held_out
    ]


def calibration_texts(num_samples: int, max_chars: int = 2048) -> list[str]:
    """`num_samples` chunks of at most `max_chars` characters from the calibration part."""
    chunks = []
    for text in _split(held_out=False):
        for start in range(0, len(text), max_chars):
            chunk = text[start : start + max_chars].strip()
            if len(chunk) > max_chars // 4:
                chunks.append(chunk)
    if len(chunks) < num_samples:
        raise ValueError(f"the calibration corpus has {len(chunks)} chunks, {num_samples} asked")
    # Spread the picks over the whole corpus instead of taking its first topics.
    step = len(chunks) / num_samples
    return [chunks[int(i * step)] for i in range(num_samples)]


def held_out_texts() -> list[str]:
    """The evaluation part of the corpus (never used for calibration)."""
    return _split(held_out=True)


def corpus_hash() -> str:
    digest = hashlib.sha256()
    for name, text in _topics():
        digest.update(name.encode())
        digest.update(text.encode())
    return digest.hexdigest()
