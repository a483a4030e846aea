"""`modelship serve`: one replica of a model folder with the OpenAI API."""

from __future__ import annotations

import dataclasses
import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from modelship.adapter_names import ADAPTER_NAME_RULE, is_adapter_name
from modelship.cli.common import CONFIG_EXIT_CODE, LogFormat, fail, setup_logging
from modelship.engine.options import EngineOptions
from modelship.pipeline.errors import PipelineError
from modelship.server.reasoning import ReasoningParser

app = typer.Typer()


class KVCacheDtype(StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    int8 = "int8"
    fp8 = "fp8"
    fp8_e4m3 = "fp8_e4m3"


class TraceExporter(StrEnum):
    none = "none"
    console = "console"
    file = "file"
    otlp = "otlp"


class EngineCorePlacement(StrEnum):
    auto = "auto"
    process = "process"
    thread = "thread"


_ENGINE = EngineOptions()  # the defaults, shared with pipeline.yaml's serve.engine


@app.command()
def serve(
    model_dir: Annotated[Path, typer.Argument(help="An HF model folder (base, variant, release).")],
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name clients use (default: the folder name).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="MODELSHIP_API_KEY",
            help="Require this bearer key. Prefer the environment variable: every user "
            "can read a command line (ps).",
        ),
    ] = None,
    variant: Annotated[
        str | None,
        typer.Option(
            help="Variant label on metrics and /ready (default: the `variant` the model "
            "folder's manifest.json names, as a release's or an optimized variant's does; "
            "else base)."
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = _ENGINE.device,
    dtype: Annotated[
        str | None, typer.Option(help="float32, bfloat16 or float16 (default: per device).")
    ] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="Context length cap (default: the model's).")
    ] = _ENGINE.max_model_len,
    max_num_seqs: Annotated[int, typer.Option(help="Sequences per step.")] = _ENGINE.max_num_seqs,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="Token budget per step.")
    ] = _ENGINE.max_num_batched_tokens,
    max_prefill_chunk: Annotated[
        int, typer.Option(help="Most prompt tokens in a step that also decodes streams.")
    ] = _ENGINE.max_prefill_chunk,
    kv_cache_memory_mb: Annotated[
        int, typer.Option(help="KV cache budget in MiB.")
    ] = _ENGINE.kv_cache_memory_mb,
    kv_cache_dtype: Annotated[
        KVCacheDtype,
        typer.Option(
            help="KV cache dtype (auto: fp32 on CPU, the compute dtype on CUDA); int8 holds "
            "~3.7x the tokens of fp32 in the same memory (CPU kernel and SDPA backends); fp8 "
            "(e4m3) as many (SDPA backend)."
        ),
    ] = KVCacheDtype(_ENGINE.kv_cache_dtype or "auto"),
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = _ENGINE.block_size,
    max_waiting_requests: Annotated[
        int, typer.Option(help="Queue bound before 429 (requests).")
    ] = _ENGINE.max_waiting_requests,
    prefix_caching: Annotated[
        bool, typer.Option(help="Reuse cached prompt blocks.")
    ] = _ENGINE.prefix_caching,
    cuda_graphs: Annotated[
        bool, typer.Option(help="Decode steps from captured CUDA graphs (CUDA devices only).")
    ] = _ENGINE.cuda_graphs,
    cuda_graph_max_batch_size: Annotated[
        int, typer.Option(help="Largest decode batch captured (up to 256); larger run eagerly.")
    ] = _ENGINE.cuda_graph_max_batch_size,
    num_speculative_tokens: Annotated[
        int,
        typer.Option(
            help="Speculative decoding (prompt lookup, or --speculative-model): draft tokens "
            'verified per step (0: off). Requests opt in with "speculative": true; the same '
            "output distribution either way."
        ),
    ] = _ENGINE.num_speculative_tokens,
    speculative_model: Annotated[
        str | None,
        typer.Option(
            help="Draft model folder (a smaller model of the same tokenizer) for speculative "
            "decoding; needs --num-speculative-tokens. Without it: prompt lookup."
        ),
    ] = _ENGINE.speculative_model,
    speculative_by_default: Annotated[
        bool, typer.Option(help='Speculate for requests that do not say ("speculative").')
    ] = _ENGINE.speculative_by_default,
    speculative_max_batch_size: Annotated[
        int, typer.Option(help="No drafts in steps with more running sequences than this.")
    ] = _ENGINE.speculative_max_batch_size,
    speculative_draft_token_cost: Annotated[
        float,
        typer.Option(
            min=0,
            help="A drafted token's share of a plain decode step's time (about 0.3 on a "
            "2-core CPU, 0.02 on a GPU): each sequence drafts as many tokens as pay for it.",
        ),
    ] = _ENGINE.speculative_draft_token_cost,
    tensor_parallel_size: Annotated[
        int,
        typer.Option(
            help="Shard attention and MLP over this many processes (Megatron-style; gloo on "
            "CPU, NCCL on CUDA, one GPU each); dense checkpoints only."
        ),
    ] = _ENGINE.tensor_parallel_size,
    lora: Annotated[
        list[str] | None,
        typer.Option(
            help="A LoRA adapter (PEFT folder) served over the model as NAME=PATH; repeat for "
            "more. Requests name it in `model`."
        ),
    ] = None,
    max_loras: Annotated[
        int, typer.Option(help="LoRA adapters resident at once (least recently used evicted).")
    ] = 4,
    enable_lora_admin: Annotated[
        bool,
        typer.Option(
            help="Let holders of the API key load and unload LoRA adapters at runtime "
            "(POST /v1/load_lora_adapter, /v1/unload_lora_adapter)."
        ),
    ] = False,
    max_n: Annotated[int, typer.Option(help="Most completions (n) per request.")] = 16,
    max_stop: Annotated[
        int, typer.Option(help="Most stop strings (and stop token ids) per request.")
    ] = 16,
    max_stop_chars: Annotated[int, typer.Option(help="Longest stop string.")] = 256,
    max_prompts: Annotated[int, typer.Option(help="Most prompts per completion request.")] = 64,
    max_body_mb: Annotated[
        int, typer.Option(help="Largest request body in MiB (413 beyond).")
    ] = 16,
    grace_period: Annotated[
        float, typer.Option(help="Seconds to finish requests on SIGTERM.")
    ] = 30.0,
    stall_timeout: Annotated[
        float,
        typer.Option(
            min=1.0,
            help="Seconds one engine step may take before the replica reports itself "
            "stalled (/ready and /health 503, so it is routed around and restarted).",
        ),
    ] = 120.0,
    fd: Annotated[
        int | None,
        typer.Option(
            help="Listen on this inherited, already bound socket instead of --host/--port "
            "(a parent process that chose the port hands it over without a race)."
        ),
    ] = None,
    trace_exporter: Annotated[
        TraceExporter,
        typer.Option(help="Where spans go: none (tracing off), console, file, otlp."),
    ] = TraceExporter.none,
    trace_endpoint: Annotated[
        str | None,
        typer.Option(
            help="OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (else "
            "$OTEL_EXPORTER_OTLP_ENDPOINT)."
        ),
    ] = None,
    trace_file: Annotated[
        Path | None, typer.Option(help="JSON lines of spans, appended (--trace-exporter file).")
    ] = None,
    trace_sample_ratio: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Share of new traces sampled (0..1); a "
            "traceparent decides for requests that bring one.",
        ),
    ] = 1.0,
    log_format: Annotated[
        LogFormat, typer.Option(help="text, or json: one object per line with trace ids.")
    ] = LogFormat.text,
    engine_core: Annotated[
        EngineCorePlacement,
        typer.Option(
            help="Where the engine core runs: process (its own, beside the HTTP process), "
            "thread (of the server's process) or auto (process with 4+ cores: on fewer, "
            "the HTTP process preempts the core's kernel threads and costs more than the "
            "GIL it saves; docs/performance.md).",
        ),
    ] = EngineCorePlacement.auto,
    reasoning_parser: Annotated[
        ReasoningParser,
        typer.Option(
            help="Split <think>...</think> into reasoning_content: qwen3, deepseek_r1 (the "
            "output starts thinking), none, or auto (qwen3 when the chat template mentions "
            "<think>).",
        ),
    ] = ReasoningParser.auto,
) -> None:
    """Serve a model with the OpenAI API (chat, completions, models, metrics)."""
    from pydantic import ValidationError

    from modelship.config import format_errors
    from modelship.pipeline.acquire import validate_model_folder
    from modelship.server.launcher import serve as run_server
    from modelship.server.limits import RequestLimitsConfig
    from modelship.tracing import TracingConfig

    engine_process = engine_core is EngineCorePlacement.process or (
        engine_core is EngineCorePlacement.auto and (os.cpu_count() or 1) >= 4
    )
    try:
        validate_model_folder(model_dir)
        if speculative_model:
            validate_model_folder(Path(speculative_model))
        limits = RequestLimitsConfig(max_n, max_stop, max_stop_chars, max_prompts, max_body_mb)
        options = EngineOptions(
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_prefill_chunk=max_prefill_chunk,
            kv_cache_memory_mb=kv_cache_memory_mb,
            kv_cache_dtype=None if kv_cache_dtype is KVCacheDtype.auto else kv_cache_dtype.value,
            block_size=block_size,
            max_waiting_requests=max_waiting_requests,
            prefix_caching=prefix_caching,
            cuda_graphs=cuda_graphs,
            cuda_graph_max_batch_size=cuda_graph_max_batch_size,
            num_speculative_tokens=num_speculative_tokens,
            speculative_model=speculative_model,
            speculative_by_default=speculative_by_default,
            speculative_max_batch_size=speculative_max_batch_size,
            speculative_draft_token_cost=speculative_draft_token_cost,
            tensor_parallel_size=tensor_parallel_size,
        )
        config = options.to_engine_config()
        if lora:
            adapters = _parse_loras(lora, served_model_name or model_dir.resolve().name)
            config = dataclasses.replace(config, loras=adapters, max_loras=max_loras)
        if enable_lora_admin:  # the projections hooked even before any adapter arrives
            config = dataclasses.replace(config, enable_lora=True, max_loras=max_loras)
        if trace_exporter is TraceExporter.file and trace_file is None:
            fail("--trace-exporter file needs --trace-file PATH", CONFIG_EXIT_CODE)
        tracing = TracingConfig(
            exporter=trace_exporter.value,
            endpoint=trace_endpoint,
            file=trace_file,
            sample_ratio=trace_sample_ratio,
        )
    except ValidationError as exc:  # the message names the flag's field
        fail(format_errors(exc, "option"), CONFIG_EXIT_CODE)
    except (PipelineError, ValueError) as exc:  # not a model folder, or a bad option
        fail(str(exc), CONFIG_EXIT_CODE)
    import socket

    setup_logging(log_format.value)
    code = run_server(
        model_dir,
        host=host,
        port=port,
        served_model_name=served_model_name,
        api_key=api_key,
        variant=variant or manifest_variant(model_dir),
        grace_period_s=grace_period,
        engine_config=config,
        sock=socket.socket(fileno=fd) if fd is not None else None,
        limits=limits,
        engine_process=engine_process,
        stall_timeout_s=stall_timeout,
        tracing=tracing,
        lora_admin=enable_lora_admin,
        reasoning_parser=reasoning_parser,
    )
    if code:
        raise typer.Exit(code)


def manifest_variant(model_dir: Path) -> str:
    """The variant a published folder's manifest names: a release (`production` included,
    which Kubernetes pods serve without knowing which variant select published) or an
    optimized variant. A folder that is no published artifact serves `base`."""
    from modelship.storage import StorageError, read_manifest

    try:
        variant = read_manifest(model_dir).extra.get("variant")
    except StorageError:  # no manifest (a plain HF folder), or one that cannot be read
        return "base"
    return variant if isinstance(variant, str) and variant else "base"


def _parse_loras(specs: list[str], model_name: str) -> tuple[tuple[str, str], ...]:
    """`--lora NAME=PATH` values as (name, path); a bad one is a usage error naming it."""
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
    return tuple(adapters.items())
