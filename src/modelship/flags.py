"""A pydantic model's fields as command-line flags, in both directions.

Each leaf field is one flag, `--` + its name with dashes (`max_num_seqs` ->
`--max-num-seqs`); a `Flag` in the field's `Annotated` metadata renames it, names the
value that stands for None, or (on a nested model) prefixes its fields' names. The field's
`description` is the flag's help, its default the flag's default. `flag_specs` lists the
flags of a model class, `flag_args` writes an instance as arguments, and `values_from_params`
reads parsed flag values back into the model's nested data: the command line that builds
a replica and the parser that reads it agree because both come from here. A leaf: pydantic
only, no CLI library.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from types import NoneType, UnionType
from typing import Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Le
from pydantic import BaseModel


@dataclass(frozen=True)
class Flag:
    """How a field deviates from the default spelling of its flag."""

    param: str | None = None  # the parameter name (flag: --param-with-dashes); None: the field's
    none_as: str | None = None  # the flag value that means None (e.g. "auto")
    prefix: str = ""  # a nested model: its fields' parameter names start with this
    # a nested model: no flags at all while it equals its default (e.g. tracing off)
    omit_default: bool = False
    # other spellings the parser also takes (e.g. vLLM's): "--name" for a value, and for a
    # bool "--on/--off", or " /--off" for an alias of the negative only
    aliases: tuple[str, ...] = ()
    # other spellings of values (alias -> value), e.g. ("half", "float16") for vLLM's dtype
    value_aliases: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class FlagSpec:
    """One leaf field as a flag."""

    path: tuple[str, ...]  # field names from the top model down to the leaf
    param: str  # the parameter name
    annotation: Any  # the field's type
    default: Any
    help: str
    none_as: str | None = None
    minimum: float | None = None  # the field's ge, for the parser to check (and show)
    maximum: float | None = None  # its le
    aliases: tuple[str, ...] = ()  # `Flag.aliases`
    value_aliases: tuple[tuple[str, str], ...] = ()  # `Flag.value_aliases`

    @property
    def flag(self) -> str:
        return "--" + self.param.replace("_", "-")

    @property
    def declarations(self) -> tuple[str, ...]:
        """Every spelling of the flag for the parser: () while there is only the default
        one (the parser derives it, and `--no-` for a bool), else all of them."""
        if not self.aliases:
            return ()
        is_bool = unwrap_optional(self.annotation)[0] is bool
        name = self.flag.removeprefix("--")
        return (f"--{name}/--no-{name}" if is_bool else self.flag, *self.aliases)

    @property
    def choices(self) -> tuple[str, ...] | None:
        """A Literal field's values (with `none_as` and the value aliases), else None."""
        base, _ = unwrap_optional(self.annotation)
        if get_origin(base) is not Literal:
            return None
        extra = (self.none_as,) if self.none_as is not None else ()
        return (*get_args(base), *extra, *(alias for alias, _ in self.value_aliases))

    @property
    def is_mapping(self) -> bool:
        """A dict field: one `--flag KEY=VALUE` per item."""
        return get_origin(unwrap_optional(self.annotation)[0]) is dict


def unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """(`X`, True) for `X | None`, else (annotation, False)."""
    if get_origin(annotation) in (Union, UnionType):
        args = [arg for arg in get_args(annotation) if arg is not NoneType]
        if len(args) == 1 and len(args) < len(get_args(annotation)):
            return args[0], True
    return annotation, False


def _flag_of(metadata: list[Any]) -> Flag:
    return next((item for item in metadata if isinstance(item, Flag)), Flag())


def _nested(annotation: Any) -> type[BaseModel] | None:
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def flag_specs(
    model: type[BaseModel], prefix: str = "", path: tuple[str, ...] = ()
) -> list[FlagSpec]:
    """The flags of `model`'s leaf fields, in field order (nested models in place)."""
    specs = []
    for name, field in model.model_fields.items():
        flag = _flag_of(field.metadata)
        nested = _nested(field.annotation)
        if nested is not None:
            specs += flag_specs(nested, prefix + flag.prefix, (*path, name))
            continue
        specs.append(
            FlagSpec(
                path=(*path, name),
                param=prefix + (flag.param or name),
                annotation=field.annotation,
                default=field.get_default(call_default_factory=True),
                help=field.description or "",
                none_as=flag.none_as,
                minimum=next((m.ge for m in field.metadata if isinstance(m, Ge)), None),
                maximum=next((m.le for m in field.metadata if isinstance(m, Le)), None),
                aliases=flag.aliases,
                value_aliases=flag.value_aliases,
            )
        )
    return specs


def _format(value: Any) -> str:
    if isinstance(value, float):  # 30.0 as "30"; repr keeps every digit of the rest
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, Enum):
        return str(value.value)
    return str(value)


def _leaf_args(param: str, none_as: str | None, value: Any) -> Iterator[str]:
    flag = "--" + param.replace("_", "-")
    if value is None:
        if none_as is not None:
            yield from (flag, none_as)
    elif isinstance(value, bool):
        yield flag if value else "--no-" + flag.removeprefix("--")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from (flag, f"{key}={item}")
    else:
        yield from (flag, _format(value))


def flag_args(options: BaseModel, exclude: Collection[str] = (), prefix: str = "") -> list[str]:
    """`options` as flags, every field given (a command line that says it all), except the
    top-level fields named in `exclude`, None values without a `none_as`, and nested models
    marked `omit_default` while they equal their default."""
    args: list[str] = []
    for name, field in type(options).model_fields.items():
        if name in exclude:
            continue
        value = getattr(options, name)
        flag = _flag_of(field.metadata)
        if isinstance(value, BaseModel):
            if flag.omit_default and value == field.get_default(call_default_factory=True):
                continue
            args += flag_args(value, prefix=prefix + flag.prefix)
            continue
        args += _leaf_args(prefix + (flag.param or name), flag.none_as, value)
    return args


def values_from_params(specs: list[FlagSpec], params: Mapping[str, Any]) -> dict[str, Any]:
    """Parsed flag values (parameter name -> value, as a CLI parser hands them over) as the
    model's nested data, ready for `model_validate`: enums as their values, `none_as` as
    None. A mapping field's value must already be a dict (the caller parses KEY=VALUE)."""
    data: dict[str, Any] = {}
    for spec in specs:
        value = params[spec.param]
        if isinstance(value, Enum):
            value = value.value
        value = dict(spec.value_aliases).get(value, value) if isinstance(value, str) else value
        if spec.none_as is not None and value == spec.none_as:
            value = None
        target = data
        for name in spec.path[:-1]:
            target = target.setdefault(name, {})
        target[spec.path[-1]] = value
    return data
