"""Prometheus metrics with vLLM's names under a `modelship:` prefix.

| modelship metric                              | vLLM metric                         | kind      |
|-----------------------------------------------|-------------------------------------|-----------|
| modelship:num_requests_running                | vllm:num_requests_running           | gauge     |
| modelship:num_requests_waiting                | vllm:num_requests_waiting           | gauge     |
| modelship:kv_cache_usage_perc                 | vllm:kv_cache_usage_perc            | gauge 0-1 |
| modelship:prefix_cache_queries_total (tokens) | vllm:prefix_cache_queries_total     | counter   |
| modelship:prefix_cache_hits_total (tokens)    | vllm:prefix_cache_hits_total        | counter   |
| modelship:num_preemptions_total               | vllm:num_preemptions_total          | counter   |
| modelship:prompt_tokens_total                 | vllm:prompt_tokens_total            | counter   |
| modelship:generation_tokens_total             | vllm:generation_tokens_total        | counter   |
| modelship:spec_decode_num_drafts_total        | vllm:spec_decode_num_drafts_total   | counter   |
| modelship:spec_decode_num_draft_tokens_total  | vllm:spec_decode_num_draft_tokens   | counter   |
| modelship:spec_decode_num_accepted_tokens_total | vllm:spec_decode_num_accepted_tokens | counter |
| modelship:request_success_total{finished_reason} | vllm:request_success_total       | counter   |
| modelship:time_to_first_token_seconds         | vllm:time_to_first_token_seconds    | histogram |
| modelship:inter_token_latency_seconds         | vllm:inter_token_latency_seconds    | histogram |
| modelship:e2e_request_latency_seconds         | vllm:e2e_request_latency_seconds    | histogram |
| modelship:request_queue_time_seconds          | vllm:request_queue_time_seconds     | histogram |

Every series carries `model_name` and `variant` labels. Engine-side gauges and counters
are read from the engine's stats snapshot at scrape time; request metrics are recorded by
the serving layer as requests finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from modelship.engine.outputs import EngineStats

PREFIX = "modelship:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator:
        stats = self._stats()
        names, values = list(self._labels), list(self._labels.values())
        gauges = [
            ("num_requests_running", "Requests running on the engine.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("kv_cache_usage_perc", "KV cache usage (1 = full).", stats.kv_cache_usage),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits),
            ("num_preemptions", "Sequences preempted (recomputed later).", stats.num_preemptions),
            ("spec_decode_num_drafts", "Sequence steps that verified speculative drafts.",
             stats.spec_num_drafts),
            ("spec_decode_num_draft_tokens", "Speculative draft tokens verified.",
             stats.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
             stats.spec_num_accepted_tokens),
        ]  # fmt: skip
        for name, doc, value in counters:
            family = CounterMetricFamily(PREFIX + name, doc, labels=names)
            family.add_metric(values, value)
            yield family


class ServerMetrics:
    """The metrics of one replica (its own registry, so tests can run many in a process)."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, variant: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "variant": variant}
        names = list(labels)
        self.registry.register(_EngineCollector(stats, labels))

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*names, *extra], registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                PREFIX + name, doc, names, buckets=_LATENCY_BUCKETS, registry=self.registry
            )

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(**labels)
        self._success = counter(
            "request_success", "Finished requests by reason.", ("finished_reason",)
        )
        self._labels = self.labels = labels
        # Per adapter: only the names of served adapters, so the label set stays bounded.
        self.lora_requests = counter(
            "lora_requests", "Requests served by each LoRA adapter.", ("lora_name",)
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.").labels(
            **labels
        )
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.").labels(**labels)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency.").labels(**labels)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to the first scheduled step."
        ).labels(**labels)

    def request_finished(self, finished_reason: str) -> None:
        self._success.labels(**self._labels, finished_reason=finished_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
