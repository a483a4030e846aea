"""What one replica is started with, defined once: `ServeOptions`.

Every field is a `modelship serve` flag (`modelship.flags`: the field's name, default and
description are the flag's), and `replica_args` writes the options as that command line,
so the three launchers of replicas (`modelship up`'s fleet, the Kubernetes pods,
select's measurements) cannot disagree with the parser. `vllm_args` spells the engine
options for a vLLM replica instead. `ReplicaOptions` holds the part pipeline.yaml's
`serve:` section sets (`config.ServeConfig` adds the address and key); the rest comes
from elsewhere in the config (the gateway's request caps, the log format, tracing) or
from the launcher (the variant, runtime adapters). Adding an engine knob: one field in
`EngineOptions` (+ one line in `vllm_args` if vLLM has it). A leaf: pydantic only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from modelship.adapter_names import ADAPTER_NAME_RULE, is_adapter_name
from modelship.engine.options import EngineOptions
from modelship.flags import Flag, flag_args
from modelship.tracing import TRACE_FLAG_PREFIX, TracingConfig

# The KV cache dtypes both engines have; another one than the model's dtype is refused when
# rendering for vLLM (`deploy.render.config_problems`).
VLLM_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
# Last on a replica's command line: the Helm chart writes them after the rest, from values
# of its own.
LAST_FLAGS = ("grace_period_s", "stall_timeout_s", "variant")


class ReplicaOptions(BaseModel):
    """The replica options pipeline.yaml's `serve:` section holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str | None = Field(  # None: the model's slug (the folder's name)
        default=None,
        description="Model name clients use (default: the model's slug in storage, else the "
        "folder's name).",
    )
    engine: EngineOptions = Field(default_factory=EngineOptions)
    # LoRA adapters (PEFT folders) every replica serves over the model: name -> folder;
    # requests name them in `model`, tenants' `allowed_models` say who may
    loras: Annotated[dict[str, str], Flag(param="lora")] = Field(
        default_factory=dict,
        description="A LoRA adapter (PEFT folder) served over the model as NAME=PATH; repeat "
        "for more. Requests name it in `model`.",
    )
    max_loras: int = Field(
        default=4, ge=1, description="LoRA adapters resident at once (least recently used evicted)."
    )
    grace_period_s: Annotated[float, Flag(param="grace_period")] = Field(
        default=30.0, ge=0, description="Seconds to finish requests on SIGTERM."
    )
    # one engine step running past this makes a replica report itself stalled (/ready and
    # /health 503): routed around, then replaced
    stall_timeout_s: Annotated[float, Flag(param="stall_timeout")] = Field(
        default=120.0,
        ge=1.0,
        description="Seconds one engine step may take before the replica reports itself "
        "stalled (/ready and /health 503, so it is routed around and restarted).",
    )

    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "generic"] = Field(
        default="auto",
        description="The form the model writes tool calls in (auto: read from its chat "
        "template; generic: tools described in a system turn, calls as <tool_call> blocks).",
    )

    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek_r1"] = Field(
        default="auto",
        description="Split <think>...</think> into reasoning_content: qwen3, deepseek_r1 (the "
        "output starts thinking), none, or auto (qwen3 when the chat template mentions "
        "<think>).",
    )

    @field_validator("loras")
    @classmethod
    def _adapter_names(cls, loras: dict[str, str]) -> dict[str, str]:
        for name in loras:
            if not is_adapter_name(name):
                raise ValueError(f"{name!r}: an adapter name is {ADAPTER_NAME_RULE}")
        return loras


class ServeOptions(ReplicaOptions):
    """All of a replica's options (`modelship serve` less the model folder, the address,
    the inherited socket and the API key, which travels in the environment)."""

    variant: str | None = Field(
        default=None,
        description="Variant label on metrics and /ready (default: the `variant` the model "
        "folder's manifest.json names, as a release's or an optimized variant's does; else "
        "base).",
    )
    enable_lora_admin: bool = Field(
        default=False,
        description="Let holders of the API key load and unload LoRA adapters at runtime "
        "(POST /v1/load_lora_adapter, /v1/unload_lora_adapter).",
    )
    # Request caps (`server.limits`); `modelship up` and the pods give the gateway's, so a
    # replica never refuses what the gateway let through (a 400 nobody could explain).
    max_n: int = Field(default=16, ge=1, description="Most completions (n) per request.")
    max_stop: int = Field(
        default=16, ge=1, description="Most stop strings (and stop token ids) per request."
    )
    max_stop_chars: int = Field(default=256, ge=1, description="Longest stop string.")
    max_prompts: int = Field(default=64, ge=1, description="Most prompts per completion request.")
    max_body_mb: int = Field(
        default=16, ge=1, description="Largest request body in MiB (413 beyond)."
    )
    log_format: Literal["text", "json"] = Field(
        default="text", description="text, or json: one object per line with trace ids."
    )
    tracing: Annotated[TracingConfig, Flag(prefix=TRACE_FLAG_PREFIX, omit_default=True)] = Field(
        default_factory=TracingConfig
    )
    engine_core: Literal["auto", "process", "thread"] = Field(
        default="auto",
        description="Where the engine core runs: process (its own, beside the HTTP process), "
        "thread (of the server's process) or auto (process with 4+ cores: on fewer, the HTTP "
        "process preempts the core's kernel threads and costs more than the GIL it saves; "
        "docs/performance.md).",
    )

    def replica_args(self, exclude: Collection[str] = ()) -> list[str]:
        """These options as `modelship serve` flags (after the model folder), every field
        given except those named in `exclude`; `modelship serve` parses them back into
        equal options."""
        last = [name for name in LAST_FLAGS if name not in exclude]
        return [*flag_args(self, exclude={*exclude, *last}),
                *flag_args(self, exclude=set(type(self).model_fields) - set(last))]  # fmt: skip

    def vllm_args(self) -> list[str]:
        """The options vLLM has, in `vllm serve` flags (after the model, name and address);
        the variants are compressed-tensors checkpoints it reads as they are."""
        engine = self.engine
        args = [
            "--max-num-seqs", str(engine.max_num_seqs),
            "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
            "--enable-prefix-caching" if engine.prefix_caching else "--no-enable-prefix-caching",
            # The gateway sends each tenant's class as `priority` (vLLM refuses any but 0
            # without this policy).
            "--scheduling-policy", "priority",
        ]  # fmt: skip
        if engine.max_model_len:
            args += ["--max-model-len", str(engine.max_model_len)]
        if engine.dtype:
            args += ["--dtype", engine.dtype]
        if engine.kv_cache_memory_fraction is not None:  # vLLM's share is of the whole GPU
            args += ["--gpu-memory-utilization", str(engine.kv_cache_memory_fraction)]
        if engine.kv_cache_dtype in VLLM_KV_CACHE_DTYPES:  # otherwise the model's ("auto")
            args += ["--kv-cache-dtype", engine.kv_cache_dtype]
        if not engine.cuda_graphs:
            args += ["--enforce-eager"]
        if engine.speculative_model:  # vLLM's draft-model speculation (it speculates for all)
            spec = {"model": engine.speculative_model,
                    "num_speculative_tokens": engine.num_speculative_tokens}  # fmt: skip
            args += ["--speculative-config", json.dumps(spec)]
        elif engine.num_speculative_tokens:  # vLLM's prompt lookup (it speculates for all)
            spec = {"method": "ngram", "num_speculative_tokens": engine.num_speculative_tokens,
                    "prompt_lookup_max": 3, "prompt_lookup_min": 1}  # fmt: skip
            args += ["--speculative-config", json.dumps(spec)]
        if self.tool_call_parser in ("hermes", "llama3_json", "mistral"):  # vLLM's names
            args += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.reasoning_parser in ("qwen3", "deepseek_r1"):  # vLLM's names
            args += ["--reasoning-parser", self.reasoning_parser]
        if self.loras:  # vLLM serves them by the same names: the request's `model` picks one
            modules = [f"{name}={path}" for name, path in self.loras.items()]
            args += ["--enable-lora", "--max-loras", str(self.max_loras),
                     "--lora-modules", *modules]  # fmt: skip
        return args

    def to_engine_config(self):
        """The engine's `EngineConfig`, with the adapters (and LoRA hooks for runtime loads
        with `enable_lora_admin`, even before any adapter arrives)."""
        import dataclasses

        config = self.engine.to_engine_config()
        if self.loras:
            adapters = tuple(self.loras.items())
            config = dataclasses.replace(config, loras=adapters, max_loras=self.max_loras)
        if self.enable_lora_admin:
            config = dataclasses.replace(config, enable_lora=True, max_loras=self.max_loras)
        return config

    def engine_process(self) -> bool:
        """Whether the engine core runs in a process of its own (`engine_core`)."""
        if self.engine_core == "auto":
            return (os.cpu_count() or 1) >= 4
        return self.engine_core == "process"
