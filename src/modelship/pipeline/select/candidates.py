"""What select measures: candidates, each a variant's folder served with some numerics.

Most candidates are the optimized variants as they are (served with pipeline.yaml's
`serve.engine`). A served-numerics candidate is a variant's folder with engine options on
top, measured like any other (quality with those numerics, serving through a replica
started with them) and published like any other: a release made from it records the
options in its manifest (`extra["engine"]`), and `modelship serve` of the release serves
them where its flags say auto (`EngineOptions.with_measured`), so what was measured is
what serves.

The one such option today is the 4-bit output head (`lm_head: int4`,
`model.quant.int4_head`). To keep select's time in bounds it is measured for one int4
variant only: the one whose teacher-forced quality came closest to the base (lowest KL
divergence), since the head's rounding adds to what the variant already lost; it is named
`<variant>-int4head`. It is not proposed where pipeline.yaml pins `serve.engine.lm_head`,
where replicas run on a GPU, or without modelship's CPU kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelship.model import cpu_kernels
from modelship.model.config import ModelConfig, ModelConfigError
from modelship.model.quant.int4_head import int4_head_supports
from modelship.serve_options import ServeOptions
from modelship.storage import Storage, StorageError, read_manifest

INT4_HEAD = {"lm_head": "int4"}
INT4_HEAD_SUFFIX = "-int4head"


@dataclass(frozen=True)
class Candidate:
    """One row of select's report and a possible release."""

    name: str  # evaluations/<name>.json, the report's column, the release's variant label
    variant: str  # whose folder is loaded: an optimized variant (or the base)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineOptions fields on top

    @classmethod
    def of(cls, evaluation: dict[str, Any]) -> Candidate:
        """The candidate an evaluation was made for (plain variants record no engine)."""
        name = evaluation["variant"]
        return cls(name, evaluation.get("source_variant", name), evaluation.get("engine") or {})

    def serve_options(self, base: ServeOptions) -> ServeOptions:
        """`base` (pipeline.yaml's serve options) with this candidate's numerics."""
        if not self.engine:
            return base
        engine = type(base.engine).model_validate(base.engine.model_dump() | self.engine)
        return base.model_copy(update={"engine": engine})


def int4_head_candidate(
    storage: Storage,
    slug: str,
    evaluations: dict[str, dict[str, Any]],
    variants: list[str],
    serve: ServeOptions,
) -> Candidate | None:
    """The 4-bit-head candidate of the measured int4 variant closest to the base (module
    docstring), or None where none is proposed: no int4 variant measured, the head pinned
    in pipeline.yaml, replicas on a GPU, or no CPU kernels here."""
    from modelship.engine.options import resolve_device

    engine = serve.engine
    if engine.lm_head != "auto" or resolve_device(engine.device) != "cpu":
        return None
    measured = [
        (evaluations[name]["quality"]["kl_divergence"], index, name)
        for index, name in enumerate(variants)
        if "quality" in evaluations.get(name, {})
        and _takes_int4_head(storage.variant_dir(slug, name))
    ]
    if not measured or not cpu_kernels.load():
        return None
    _, _, best = min(measured)
    return Candidate(best + INT4_HEAD_SUFFIX, best, dict(INT4_HEAD))


def _takes_int4_head(folder: Path) -> bool:
    """A variant whose manifest's recipe wrote 4-bit weights (the optimize stage's GPTQ
    and AWQ), with a head the kernel takes (a width in whole groups of 64)."""
    try:
        recipe = read_manifest(folder).extra.get("recipe") or {}
        config = ModelConfig.from_dir(folder)
    except (StorageError, ModelConfigError, OSError):
        return False
    return recipe.get("bits") == 4 and int4_head_supports(config.vocab_size, config.hidden_size)
