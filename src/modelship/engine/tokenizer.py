"""Loading a model folder's tokenizer without transformers' auto-class machinery.

`AutoTokenizer` imports transformers' model registries on first use (3.3 s measured on a
2-core machine, most of a replica's cold start); a folder with a `tokenizer.json` loads the
same fast tokenizer class directly (1.0 s). Folders without one fall back to AutoTokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: str | Path) -> Any:
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
