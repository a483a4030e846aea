"""`modelship verify --rebuild`: make a published variant again and compare its bytes.

Optimize is deterministic (same base, recipe, code and tool versions: the same files; see
`llmcompressor_schemes._deterministic`), so a variant can be checked by making it again
from what its manifest records, into a scratch folder beside it, and comparing every file's
sha256 with the manifest's. The scratch folder is removed whatever happens.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from modelship.pipeline.errors import PipelineError
from modelship.pipeline.optimize.recipe import Recipe
from modelship.pipeline.optimize.schemes import create_scheme
from modelship.storage import hash_inputs, verify_artifact
from modelship.storage.manifest import scan_files


@dataclass(frozen=True)
class Rebuilt:
    variant: str
    num_files: int
    differing: list[str]  # files whose sha256 differs (or that only one side has)
    seconds: float

    @property
    def identical(self) -> bool:
        return not self.differing


def rebuild(variant_dir: Path) -> Rebuilt:
    from modelship.pipeline.optimize.runner import inputs_of

    started = time.perf_counter()
    manifest = verify_artifact(variant_dir, full=True)  # the published files are intact
    if manifest.kind != "optimized" or "recipe" not in manifest.extra:
        raise PipelineError(f"{variant_dir}: not an optimized variant (kind {manifest.kind!r})")
    recipe = Recipe(**manifest.extra["recipe"])
    base_dir = Path(manifest.source)
    if hash_inputs(inputs_of(base_dir, recipe)) != manifest.inputs_hash:
        raise PipelineError(
            f"{variant_dir}: its inputs changed since it was made (base, recipe, code or tool "
            "versions differ): a rebuild would not be comparable; run optimize to remake it"
        )
    scratch = Path(tempfile.mkdtemp(prefix=".rebuild-", dir=variant_dir.parent))
    try:
        create_scheme(recipe.scheme).run(recipe, base_dir, scratch)
        rebuilt = {entry.path: entry.sha256 for entry in scan_files(scratch)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    published = {entry.path: entry.sha256 for entry in manifest.files}
    differing = sorted(
        p for p in published.keys() | rebuilt.keys() if published.get(p) != rebuilt.get(p)
    )
    return Rebuilt(recipe.scheme, len(published), differing, time.perf_counter() - started)
