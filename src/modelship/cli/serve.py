"""`modelship serve`: one replica of a model with the OpenAI API.

MODEL is resolved by `cli.serve_model` (a folder, a slug, a release, a Hub id, `demo`, a
.gguf). Its flags, but for the model, the storage, the address, the inherited socket and
the key, are generated from `ServeOptions`' fields (`modelship.flags`): a field is a flag,
with the field's default and description, in one of the help panels below. Before the
model loads, the options, the KV cache size (where it is known beforehand) and the port
are checked: each failure is one line and an exit code (`PORT_IN_USE_EXIT_CODE`)."""

from __future__ import annotations

import errno
import inspect
import socket
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from modelship.adapter_names import ADAPTER_NAME_RULE, is_adapter_name
from modelship.cli.common import CONFIG_EXIT_CODE, err_console, exit_code, fail, setup_logging
from modelship.cli.exit_codes import ExitCode
from modelship.cli.serve_help import PanelledCommand, flag_metavar
from modelship.flags import FlagSpec, flag_specs, unwrap_optional, values_from_params
from modelship.pipeline.errors import PipelineError
from modelship.serve_options import ServeOptions
from modelship.server.reasoning import ReasoningParser
from modelship.storage import STORAGE_ENV, Storage, StorageError
from modelship.storage.store import DEFAULT_ROOT

if TYPE_CHECKING:
    from modelship.cli.serve_model import ServedModel
    from modelship.engine.config import EngineConfig

app = typer.Typer()

# `serve` exits with this when its address is taken (or cannot be bound): checked before the
# model loads. The others are in `exit_codes.py` (2 for a MODEL that names nothing servable
# or a bad flag, 1 or 75 for a failed acquire, 3 when the warm-up step fails).
PORT_IN_USE_EXIT_CODE = ExitCode.PORT_IN_USE

# The flags ServeOptions' fields make (name, default, help), after serve's own below.
FLAGS = flag_specs(ServeOptions)

# `serve --help` groups its flags in these panels, in this order.
MODEL_PANEL, SERVER_PANEL = "Model", "Server"
ENGINE_PANEL, SCHEDULING_PANEL, SPECULATIVE_PANEL = "Engine", "Scheduling", "Speculative decoding"
LORA_PANEL, LIMITS_PANEL, OBSERVABILITY_PANEL = "LoRA", "Limits", "Observability"
_PANELS = {
    **dict.fromkeys(("served_model_name", "variant", "tool_call_parser", "reasoning_parser"),
                    MODEL_PANEL),
    **dict.fromkeys(("grace_period", "stall_timeout", "engine_core"), SERVER_PANEL),
    **dict.fromkeys(("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk",
                     "max_waiting_requests"), SCHEDULING_PANEL),
    **dict.fromkeys(("num_speculative_tokens", "speculative_by_default",
                     "speculative_max_batch_size", "speculative_draft_token_cost",
                     "speculative_model"), SPECULATIVE_PANEL),
    **dict.fromkeys(("lora", "max_loras", "enable_lora_admin"), LORA_PANEL),
    **dict.fromkeys(("max_n", "max_stop", "max_stop_chars", "max_prompts", "max_body_mb"),
                    LIMITS_PANEL),
    "log_format": OBSERVABILITY_PANEL,
}  # fmt: skip


def panel(spec: FlagSpec) -> str:
    """The help panel of a generated flag: listed above, else by the section it is in
    (tracing's flags under observability, the other engine options under engine)."""
    if spec.param in _PANELS:
        return _PANELS[spec.param]
    return {"tracing": OBSERVABILITY_PANEL, "engine": ENGINE_PANEL}.get(spec.path[0], SERVER_PANEL)


def _option(spec: FlagSpec) -> inspect.Parameter:
    """One generated flag as a typer parameter: a Literal field's values as choices, a
    mapping field as a repeatable KEY=VALUE option."""
    annotation: Any = spec.annotation
    default = spec.default
    if spec.is_mapping:
        annotation, default = list[str] | None, None
    elif spec.choices is not None:
        kind = StrEnum(spec.param.title().replace("_", ""), [(c, c) for c in spec.choices])
        nullable = unwrap_optional(spec.annotation)[1] and spec.none_as is None
        annotation = kind | None if nullable else kind
        value = spec.none_as if default is None else default
        default = None if value is None else kind(value)
    option = typer.Option(
        *spec.declarations,
        help=spec.help,
        min=spec.minimum,
        max=spec.maximum,
        metavar=flag_metavar(spec),
        rich_help_panel=panel(spec),
    )
    kind = inspect.Parameter.KEYWORD_ONLY
    return inspect.Parameter(spec.param, kind, annotation=Annotated[annotation, option],
                             default=default)  # fmt: skip


def serve(
    model: Annotated[
        str,
        typer.Argument(
            metavar="MODEL",
            help="A model folder (a release, production, a variant, a base, any HF folder), "
            "the slug of a model in storage (its production release, else its base), a .gguf "
            "file, 'demo' or a Hub repo id (the last three acquired into storage first).",
            rich_help_panel=MODEL_PANEL,
        ),
    ],
    host: Annotated[
        str,
        typer.Option(metavar="HOST", help="Interface to listen on.", rich_help_panel=SERVER_PANEL),
    ] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(
            min=1, max=65535, metavar="PORT", help="TCP port.", rich_help_panel=SERVER_PANEL
        ),
    ] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="MODELSHIP_API_KEY",
            metavar="KEY",
            help="Require this bearer key. Prefer the environment variable: every user "
            "can read a command line (ps).",
            rich_help_panel=SERVER_PANEL,
        ),
    ] = None,
    fd: Annotated[
        int | None,
        typer.Option(
            metavar="FD",
            help="Listen on this inherited, already bound socket instead of --host/--port "
            "(a parent process that chose the port hands it over without a race).",
            rich_help_panel=SERVER_PANEL,
        ),
    ] = None,
    storage: Annotated[
        Path,
        typer.Option(
            envvar=STORAGE_ENV,
            metavar="PATH",
            help="Storage root: where a slug is looked up and a Hub id, 'demo' or a .gguf is "
            "acquired to.",
            rich_help_panel=MODEL_PANEL,
        ),
    ] = Path(DEFAULT_ROOT),
    revision: Annotated[
        str | None,
        typer.Option(
            metavar="REV",
            help="Hub branch, tag or commit sha of a Hub MODEL (default: main).",
            rich_help_panel=MODEL_PANEL,
        ),
    ] = None,
    **flags: Any,
) -> None:
    """Serve a model with the OpenAI API (chat, completions, embeddings, models, metrics)."""
    from modelship.engine.errors import KVCacheTooSmallError

    served = served_model(model, Storage(storage), revision)
    options = serve_options(served.path, flags, served.name, served.measured_engine)
    check_device_usable(options.engine.device)
    try:
        engine_config = options.to_engine_config()
    except ValueError as exc:  # a combination only the resolved device shows (--device auto)
        fail(str(exc), CONFIG_EXIT_CODE)
    check_kv_cache(served.path, engine_config)
    # The port is taken before the model loads: a busy one fails in a second, not after it.
    sock = socket.socket(fileno=fd) if fd is not None else listening_socket(host, port)
    setup_logging(options.log_format)
    try:
        code = _run(served, options, engine_config, sock, host, port, api_key)
    except KVCacheTooSmallError as exc:  # a cache sized from the memory free once loaded
        fail(str(exc), CONFIG_EXIT_CODE)
    if code:
        raise typer.Exit(code)


def _run(
    served: ServedModel,
    options: ServeOptions,
    engine_config: EngineConfig,
    sock: socket.socket,
    host: str,
    port: int,
    api_key: str | None,
) -> int:
    """Serve until drained (`server.launcher.serve`); its exit code."""
    from modelship.server.launcher import serve as run_server
    from modelship.server.limits import RequestLimitsConfig

    return run_server(
        served.path,
        host=host,
        port=port,
        served_model_name=options.served_model_name or served.name,
        api_key=api_key,
        variant=options.variant or served.variant,
        grace_period_s=options.grace_period_s,
        engine_config=engine_config,
        sock=sock,
        limits=RequestLimitsConfig(
            options.max_n,
            options.max_stop,
            options.max_stop_chars,
            options.max_prompts,
            options.max_body_mb,
        ),
        engine_process=options.engine_process(),
        stall_timeout_s=options.stall_timeout_s,
        tracing=options.tracing,
        lora_admin=options.enable_lora_admin,
        tool_call_parser=options.tool_call_parser,
        reasoning_parser=ReasoningParser(options.reasoning_parser),
    )


def served_model(model: str, storage: Storage, revision: str | None) -> ServedModel:
    """MODEL resolved (and acquired where it is a Hub id, `demo` or a .gguf); a name that
    is nothing servable exits 2, a failed acquire as `modelship acquire` does (1, 75)."""
    from modelship.cli.serve_model import ServeModelError, resolve_served_model
    from modelship.progress import make_progress

    try:
        with make_progress(err_console) as progress:
            return resolve_served_model(model, storage, revision, progress)
    except ServeModelError as exc:
        fail(str(exc), CONFIG_EXIT_CODE)
    except (PipelineError, StorageError) as exc:
        fail(str(exc), exit_code(exc))


def check_kv_cache(model_dir: Path, engine_config: EngineConfig) -> None:
    """Exit 2 before loading anything where the KV cache could not hold one sequence of
    max_model_len tokens (where that is known beforehand: the engine checks again once
    loaded, for a cache sized from the memory then free)."""
    from modelship.engine.worker import check_one_sequence_fits, planned_cache_tokens

    try:  # KVCacheTooSmallError, or a config.json the engine cannot read (ModelConfigError)
        planned = planned_cache_tokens(model_dir, engine_config)
        if planned is not None:
            check_one_sequence_fits(*planned)
    except ValueError as exc:
        fail(str(exc), CONFIG_EXIT_CODE)


def listening_socket(host: str, port: int) -> socket.socket:
    """host:port bound now, before the model loads; one that is taken (or cannot be had)
    exits with `PORT_IN_USE_EXIT_CODE` and a line naming it."""
    from modelship.server.process import bind_socket

    try:
        return bind_socket(host, port)
    except OSError as exc:
        why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
        fail(
            f"{host}:{port} {why}: stop what listens there or pass --port with a free port",
            PORT_IN_USE_EXIT_CODE,
        )


# typer reads a command's parameters from its signature: the fixed ones above, then one per
# ServeOptions field in place of `**flags` (which receives them by name).
_own = list(inspect.signature(serve, eval_str=True).parameters.values())[:-1]
serve.__signature__ = inspect.Signature([*_own, *map(_option, FLAGS)])  # type: ignore[attr-defined]
app.command(cls=PanelledCommand)(serve)


def serve_options(
    model_dir: Path,
    flags: dict[str, Any],
    name: str | None = None,
    measured_engine: dict[str, Any] | None = None,
) -> ServeOptions:
    """The generated flags' parsed values as options, the model folder (and a draft
    model's, and every adapter) checked; a bad one exits with a usage error naming it.
    `name`: the model's name when --served-model-name is not given (default: the folder's),
    which no adapter may take. `measured_engine`: the numerics the release was measured
    with, served where the flags say auto (`EngineOptions.with_measured`)."""
    from pydantic import ValidationError

    from modelship.pipeline.acquire import validate_model_folder

    by_path = {spec.path: spec.flag for spec in FLAGS}
    try:
        validate_model_folder(model_dir)
        if flags.get("speculative_model"):
            validate_model_folder(Path(flags["speculative_model"]))
        if flags.get("trace_exporter") == "file" and flags.get("trace_file") is None:
            fail("--trace-exporter file needs --trace-file PATH", CONFIG_EXIT_CODE)
        name = flags.get("served_model_name") or name or model_dir.resolve().name
        flags = {**flags, "lora": _parse_loras(flags.get("lora") or [], name)}
        options = ServeOptions.model_validate(values_from_params(FLAGS, flags))
        engine = options.engine.with_measured(measured_engine or {})
        return options.model_copy(update={"engine": engine})
    except ValidationError as exc:  # the message names the flag
        lines = []
        for error in exc.errors():
            where = by_path.get(tuple(error["loc"]), "option")
            lines.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
        fail("\n".join(lines), CONFIG_EXIT_CODE)
    except (PipelineError, ValueError) as exc:  # not a model folder, or a bad option
        fail(str(exc), CONFIG_EXIT_CODE)


def check_device_usable(device: str) -> None:
    """Exit 2 with the fix, before the model loads, where this torch cannot run `device`."""
    from modelship.engine.devices import device_problem

    problem = device_problem(device)
    if problem is not None:
        fail(problem, CONFIG_EXIT_CODE)


def _parse_loras(specs: list[str], model_name: str) -> dict[str, str]:
    """`--lora NAME=PATH` values as name -> path; a bad one is a usage error naming it."""
    adapters: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            fail(f"--lora takes NAME=PATH, got {spec!r}", CONFIG_EXIT_CODE)
        if not is_adapter_name(name):
            fail(f"--lora {name!r}: a name is {ADAPTER_NAME_RULE}", CONFIG_EXIT_CODE)
        if name == model_name or name in adapters:
            fail(f"--lora {name}: the name is already taken", CONFIG_EXIT_CODE)
        if not (Path(path) / "adapter_config.json").is_file():
            message = f"--lora {name}: {path} has no adapter_config.json (not a PEFT folder)"
            fail(message, CONFIG_EXIT_CODE)
        adapters[name] = path
    return adapters
