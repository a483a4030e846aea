"""A draft model for speculative decoding made from a model itself: its first N decoder
layers (and, with --keep-last M, its last M: the middle of the stack skipped), final norm
and head (the same tokenizer, by construction), written as a servable checkpoint. No
training: the first layers alone are a poor drafter (SmolLM2-135M's first 4 of 30 layers
emit ". , and, and"), skipping middle layers keeps more of the model's predictions; the
benchmark reports the acceptance either gets as measured.

    .venv/bin/python benchmarks/make_draft.py --out DIR [--model DIR] [--layers 4]
        [--keep-last 0]

Then: `modelship serve MODEL --num-speculative-tokens 4 --speculative-model DIR`, or
benchmarks/speculative.py --draft-model DIR.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def make_draft(model: Path, out: Path, num_layers: int, keep_last: int = 0) -> Path:
    """Write the first `num_layers` and the last `keep_last` layers of `model` (renumbered;
    plus embeddings, norm, head, the tokenizer and templates) to `out`; returns `out`."""
    config = json.loads((model / "config.json").read_text())
    total = config["num_hidden_layers"]
    if num_layers < 1 or keep_last < 0 or num_layers + keep_last > total:
        raise SystemExit(f"--layers >= 1 and --keep-last >= 0 must add up to at most {total}")
    kept = list(range(num_layers)) + list(range(total - keep_last, total))
    renumber = {old: new for new, old in enumerate(kept)}
    out.mkdir(parents=True, exist_ok=True)
    for path in model.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy2(path, out / path.name)  # tokenizer, chat template, generation config
    (out / "manifest.json").unlink(missing_ok=True)  # the source's checksums; not this one
    weights = {}
    for shard in sorted(model.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            match = _LAYER.search(name)
            if match is None:
                weights[name] = tensor
            elif int(match.group(1)) in renumber:
                new = renumber[int(match.group(1))]
                weights[name[: match.start()] + f".layers.{new}." + name[match.end() :]] = tensor
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": len(kept)},
                                                indent=2))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the demo model")
    parser.add_argument("--storage", type=Path, default=ROOT / "modelship-data")
    parser.add_argument("--layers", type=int, default=4, help="first layers kept")
    parser.add_argument("--keep-last", type=int, default=0, help="last layers kept")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from modelship.pipeline.acquire import acquire
        from modelship.storage import Storage

        model = acquire("demo", Storage(args.storage)).path
    print(make_draft(model, args.out, args.layers, args.keep_last))


if __name__ == "__main__":
    main()
