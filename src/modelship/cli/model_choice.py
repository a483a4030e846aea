"""Which model a command acts on when the command line does not say it exactly.

The rule, in order:
1. `--model SLUG`: that model, which must be in storage (a near miss gets "did you mean").
2. A config that names its model (`source:` or `name:` set in pipeline.yaml): that one,
   as `modelship run` with the same config would have made it.
3. The only model in storage. With several, the error lists them and asks for `--model`;
   with none, it says how to make one. The built-in default source (the demo) is never
   guessed: a newcomer's `run ./my-model` then `up` must serve `my-model`.
"""

from __future__ import annotations

import difflib

from modelship.cli.exit_codes import ExitCode
from modelship.storage import Storage


class ModelChoiceError(Exception):
    """No model could be chosen; the message names the problem and the fix."""

    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.code = code


def choose_model(config, storage: Storage, model: str | None) -> str:
    """The slug a command acts on (the rule in the module docstring); raises
    `ModelChoiceError` when there is none to act on or the choice is ambiguous."""
    from modelship.pipeline.run import model_slug

    root = storage.root
    if not root.is_dir():
        raise ModelChoiceError(
            f"{root}: no such storage folder (pass --storage PATH or set MODELSHIP_STORAGE; "
            "`modelship run` creates it)",
            ExitCode.USAGE,
        )
    slugs = storage.models()
    if model is not None:
        if model in slugs:
            return model
        raise ModelChoiceError(_unknown_model(model, slugs, storage), ExitCode.USAGE)
    if config.model_fields_set & {"source", "name"}:
        return model_slug(config)
    if len(slugs) == 1:
        return slugs[0]
    if not slugs:
        raise ModelChoiceError(
            f"no model under {root} yet (`modelship run` makes the demo's pipeline, "
            "`modelship run SOURCE` another model's)",
            ExitCode.FAILURE,
        )
    raise ModelChoiceError(
        f"{len(slugs)} models under {root}: {', '.join(slugs)}; name one with --model SLUG",
        ExitCode.USAGE,
    )


def _unknown_model(model: str, slugs: list[str], storage: Storage) -> str:
    if not slugs:
        return f"no model {model!r} under {storage.root}: it holds no model yet"
    close = difflib.get_close_matches(model, slugs, n=1, cutoff=0.6)
    hint = f"did you mean --model {close[0]}? " if close else ""
    return f"no model {model!r} under {storage.root}; {hint}(models: {', '.join(slugs)})"
