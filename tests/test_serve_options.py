"""`ServeOptions` is the one definition of a replica's options: every field is a
`modelship serve` flag, and the command line the launchers build (`replica_args`) parses
back into the same options. A new knob is one field; these tests fail until it is one
flag of the parser too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel

from modelship.cli.serve import app as serve_app
from modelship.cli.serve import serve_options
from modelship.config import ModelshipConfig
from modelship.serve_options import ServeOptions

FIXED = {"model", "host", "port", "api_key", "fd", "storage", "revision"}  # serve's own
SHELL = {"install_completion", "show_completion"}  # typer's, on a single-command app


def leaves(model: type[BaseModel], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths of a model's leaf fields, read from pydantic (not from `modelship.flags`)."""
    out = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out += leaves(kind, (*path, name))
        else:
            out.append((*path, name))
    return out


def value_at(options: BaseModel, path: tuple[str, ...]) -> Any:
    for name in path:
        options = getattr(options, name)
    return options


def parse(options: ServeOptions, model_dir: Path) -> ServeOptions:
    """What `modelship serve MODEL_DIR <replica_args>` runs with."""
    command = typer.main.get_command(serve_app)
    context = command.make_context("serve", [str(model_dir), *options.replica_args()])
    flags = {name: value for name, value in context.params.items() if name not in FIXED}
    return serve_options(model_dir, flags)


def every_field_set(tiny_llama_dir: Path, tmp_path: Path) -> ServeOptions:
    adapter = tmp_path / "adapter"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text("{}")
    return ServeOptions(
        served_model_name="tiny",
        engine={
            "device": "cuda", "dtype": "bfloat16", "max_model_len": 128, "max_num_seqs": 8,
            "max_num_batched_tokens": 512, "max_prefill_chunk": 64, "kv_cache_memory_mb": 32,
            "kv_cache_memory_fraction": 0.5, "kv_cache_dtype": "int8", "lm_head": "dense",
            "block_size": 8,
            "max_waiting_requests": 10,
            "prefix_caching": False, "cuda_graphs": False, "cuda_graph_max_batch_size": 32,
            "adaptive_threads": False,
            "num_speculative_tokens": 3, "speculative_by_default": True,
            "speculative_max_batch_size": 4, "speculative_draft_token_cost": 0.125,
            "tensor_parallel_size": 2, "expert_parallel": True,
            "speculative_model": str(tiny_llama_dir),
        },
        loras={"sql": str(adapter)},
        max_loras=2,
        grace_period_s=7.5,
        stall_timeout_s=30,
        variant="awq",
        enable_lora_admin=True,
        max_n=3, max_stop=4, max_stop_chars=10, max_prompts=5, max_body_mb=2,
        log_format="json",
        tracing={"exporter": "file", "endpoint": "http://127.0.0.1:4318", "sample_ratio": 0.25,
                 "file": tmp_path / "spans.jsonl"},
        engine_core="thread",
        tool_call_parser="llama3_json",
        reasoning_parser="qwen3",
    )  # fmt: skip


def test_every_field_is_a_serve_flag() -> None:
    command = typer.main.get_command(serve_app)
    generated = [param for param in command.params if param.name not in FIXED | SHELL]
    assert len(generated) == len(leaves(ServeOptions))  # one flag per field, no more
    flags = {opt for param in command.params for opt in param.opts}
    for path in leaves(ServeOptions):
        # the spelling is the field's, or the one the flag names it kept from before
        name = {"grace_period_s": "grace-period", "stall_timeout_s": "stall-timeout",
                "loras": "lora"}.get(path[-1], path[-1].replace("_", "-"))  # fmt: skip
        prefix = "trace-" if path[0] == "tracing" else ""
        assert f"--{prefix}{name}" in flags, path


def test_every_field_round_trips_through_the_serve_parser(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    options = every_field_set(tiny_llama_dir, tmp_path)
    default = ServeOptions()
    for path in leaves(ServeOptions):  # a new field gets a value above, or this fails
        assert value_at(options, path) != value_at(default, path), path
    assert parse(options, tiny_llama_dir) == options
    assert parse(default, tiny_llama_dir) == default


def test_the_fleet_and_the_pods_start_replicas_with_the_configs_options(
    tiny_llama_dir: Path,
) -> None:
    config = ModelshipConfig.from_dict(
        {
            "serve": {"grace_period_s": 5, "engine": {"max_num_seqs": 7}},
            "gateway": {"request_limits": {"max_n": 20, "max_prompt_tokens": 64}},
            "log_format": "json",
        }
    )
    options = config.replica_options(variant="gptq")
    assert (options.grace_period_s, options.engine.max_num_seqs) == (5, 7)
    assert (options.max_n, options.log_format, options.variant) == (20, "json", "gptq")
    assert parse(options, tiny_llama_dir) == options
