"""The replicas' engine series, read from their /metrics and re-exposed summed over the fleet.

The health checker scrapes each replica's /metrics (`modelship:` names, or vLLM's `vllm:`,
the same after the prefix) into an `EngineSample`. The gateway's `/metrics` shows them per
variant under `modelship_gateway_replica_*`, so a Prometheus that reaches only the gateway
(`modelship up` keeps its replicas on local ports) still sees the engines' load:

| gateway series                                          | from each replica's           |
|---------------------------------------------------------|-------------------------------|
| replica_num_requests_running{variant}  (gauge, sum)     | num_requests_running          |
| replica_num_requests_waiting{variant}  (gauge, sum)     | num_requests_waiting          |
| replica_kv_cache_usage_perc{variant}   (gauge, max)     | kv_cache_usage_perc           |
| replica_prefix_cache_queries_total{variant} (counter)   | prefix_cache_queries_total    |
| replica_prefix_cache_hits_total{variant}    (counter)   | prefix_cache_hits_total       |
| replica_prompt_tokens_total{variant}        (counter)   | prompt_tokens_total           |
| replica_generation_tokens_total{variant}    (counter)   | generation_tokens_total       |

KV cache usage is a fraction per replica: the fullest replica's is shown (a sum would read
as more than full). Counters add up each replica's increase between scrapes, so one that
leaves the fleet or restarts (its counter back at 0) never makes the sum go down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens")
_DOCS = {
    "num_requests_running": "Requests running on the replicas' engines, summed by variant.",
    "num_requests_waiting": "Requests waiting in the replicas' engines, summed by variant.",
    "kv_cache_usage_perc": "KV cache usage of the fullest replica of each variant (1 = full).",
    "prefix_cache_queries": "Prompt tokens the replicas looked up in their prefix caches.",
    "prefix_cache_hits": "Prompt tokens the replicas found in their prefix caches.",
    "prompt_tokens": "Prompt tokens the replicas processed.",
    "generation_tokens": "Tokens the replicas generated.",
}


@dataclass(frozen=True)
class EngineSample:
    """One scrape of one replica: each series summed over its samples; a series the
    replica does not expose is absent."""

    values: dict[str, float]

    def get(self, name: str) -> float | None:
        return self.values.get(name)


def parse_engine_sample(text: str) -> EngineSample:
    """The engine series of a replica's /metrics text (ours, or vLLM's names)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.split(":", 1)[-1]
        if name in GAUGES:
            values[name] = sum(sample.value for sample in family.samples)
        elif name.removesuffix("_total") in COUNTERS:  # a page without TYPE lines: `_total`
            total = [s.value for s in family.samples if s.name.endswith("_total")]
            values[name.removesuffix("_total")] = sum(total)
    return EngineSample(values)


@dataclass(frozen=True)
class ReplicaEngine:
    """A replica's latest engine sample, as the fleet snapshot carries it."""

    endpoint_id: str
    variant: str
    sample: EngineSample


class EngineCollector(Collector):
    """`modelship_gateway_replica_*` from the replicas' latest samples (see the module)."""

    def __init__(self, prefix: str, replicas: Callable[[], Iterable[ReplicaEngine]]) -> None:
        self._prefix = prefix
        self._replicas = replicas
        self._last: dict[tuple[str, str], float] = {}  # (endpoint_id, counter) -> last value
        self._totals: dict[tuple[str, str], float] = {}  # (variant, counter) -> sum

    def collect(self) -> Iterator:
        replicas = list(self._replicas())
        gauges: dict[str, dict[str, float]] = {name: {} for name in GAUGES}
        for replica in replicas:
            for name in GAUGES:
                value = replica.sample.get(name)
                if value is None:
                    continue
                by_variant = gauges[name]
                old = by_variant.get(replica.variant)
                if name == "kv_cache_usage_perc":
                    by_variant[replica.variant] = value if old is None else max(old, value)
                else:
                    by_variant[replica.variant] = (old or 0.0) + value
            for name in COUNTERS:
                value = replica.sample.get(name)
                if value is None:
                    continue
                last = self._last.get((replica.endpoint_id, name), 0.0)
                # Lower than last time: the replica restarted and counts from 0 again.
                increase = value - last if value >= last else value
                self._last[(replica.endpoint_id, name)] = value
                key = (replica.variant, name)
                self._totals[key] = self._totals.get(key, 0.0) + increase
        for name in GAUGES:
            family = GaugeMetricFamily(self._prefix + name, _DOCS[name], labels=["variant"])
            for variant, value in sorted(gauges[name].items()):
                family.add_metric([variant], value)
            yield family
        for name in COUNTERS:
            family = CounterMetricFamily(self._prefix + name, _DOCS[name], labels=["variant"])
            for (variant, counter), value in sorted(self._totals.items()):
                if counter == name:
                    family.add_metric([variant], value)
            yield family
