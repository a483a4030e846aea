"""The replicas' engine series as the gateway re-exposes them (`gateway/engine_load.py`):
parsed from either engine's names, gauges summed (KV cache: the fullest replica), counters
that never go down when a replica restarts or leaves."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from modelship.gateway.engine_load import EngineCollector, ReplicaEngine, parse_engine_sample

PREFIX = "modelship_gateway_replica_"


def page(prefix: str, running: float, kv: float, generated: float) -> str:
    return (
        f"# TYPE {prefix}num_requests_running gauge\n"
        f'{prefix}num_requests_running{{model_name="m",variant="fp16"}} {running}\n'
        f"# TYPE {prefix}kv_cache_usage_perc gauge\n"
        f'{prefix}kv_cache_usage_perc{{model_name="m",variant="fp16"}} {kv}\n'
        f"# TYPE {prefix}generation_tokens_total counter\n"
        f'{prefix}generation_tokens_total{{model_name="m",variant="fp16"}} {generated}\n'
        f'{prefix}generation_tokens_created{{model_name="m",variant="fp16"}} 1.7e9\n'
    )


def scrape(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    return {
        (sample.name, sample.labels.get("variant", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_either_engines_names_parse_alike() -> None:
    ours = parse_engine_sample(page("modelship:", 2, 0.5, 40))
    vllm = parse_engine_sample(page("vllm:", 2, 0.5, 40))
    assert ours == vllm
    assert ours.get("generation_tokens") == 40  # `_created` is not a count
    assert ours.get("num_requests_waiting") is None  # not exposed: absent, not 0
    untyped = "\n".join(line for line in page("vllm:", 2, 0.5, 40).splitlines() if "#" not in line)
    assert parse_engine_sample(untyped).get("generation_tokens") == 40


def test_gauges_sum_kv_is_the_fullest_and_counters_never_go_down() -> None:
    replicas = [
        ReplicaEngine("r0", "fp16", parse_engine_sample(page("modelship:", 2, 0.25, 100))),
        ReplicaEngine("r1", "fp16", parse_engine_sample(page("vllm:", 3, 0.75, 50))),
    ]
    registry = CollectorRegistry()
    registry.register(EngineCollector(PREFIX, lambda: replicas))
    first = scrape(registry)
    assert first[(PREFIX + "num_requests_running", "fp16")] == 5
    assert first[(PREFIX + "kv_cache_usage_perc", "fp16")] == 0.75
    assert first[(PREFIX + "generation_tokens_total", "fp16")] == 150
    # r0 restarted (its counter from 0 again, now 10) and r1 left the fleet.
    replicas[:] = [ReplicaEngine("r0", "fp16", parse_engine_sample(page("modelship:", 1, 0, 10)))]
    second = scrape(registry)
    assert second[(PREFIX + "num_requests_running", "fp16")] == 1
    assert second[(PREFIX + "generation_tokens_total", "fp16")] == 160
