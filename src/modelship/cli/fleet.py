"""`modelship up`, `modelship gateway` and `modelship release ...`: the serving fleet."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from modelship.cli.common import (
    CONFIG_EXIT_CODE,
    ConfigOption,
    ConfigStorageOption,
    ModelOption,
    console,
    exit_code,
    fail,
    load_config,
    model_context,
    serve_fleet,
    setup_logging,
)
from modelship.pipeline.errors import PipelineError
from modelship.storage import StorageError

app = typer.Typer()
release_app = typer.Typer(
    help="Canary releases: send a share of traffic to another release, promote or roll back.",
    no_args_is_help=True,
)


@app.command()
def up(
    config_path: ConfigOption = None,
    model: ModelOption = None,
    storage: ConfigStorageOption = None,
    host: Annotated[str | None, typer.Option(help="Gateway interface.")] = None,
    port: Annotated[int | None, typer.Option(help="Gateway port.")] = None,
) -> None:
    """Serve the production release: gateway + autoscaled replicas (+ canary)."""
    config, store, slug = model_context(config_path, storage, model)
    serve_fleet(config, store, slug, host, port)


def _split(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


@app.command()
def gateway(
    config_path: ConfigOption = None,
    endpoint: Annotated[
        list[str] | None,
        typer.Option(help="Replica base URL (repeatable; else $MODELSHIP_GATEWAY_ENDPOINTS)."),
    ] = None,
    canary_endpoint: Annotated[
        list[str] | None,
        typer.Option(help="Canary replica URL (else $MODELSHIP_GATEWAY_CANARY_ENDPOINTS)."),
    ] = None,
    canary_weight: Annotated[
        int | None,
        typer.Option(help="Percent to the canary (else $MODELSHIP_GATEWAY_CANARY_WEIGHT)."),
    ] = None,
    tier_endpoint: Annotated[
        list[str] | None,
        typer.Option(
            help="TIER=URL: a replica of a gateway.tiers tier (repeatable; else "
            "$MODELSHIP_GATEWAY_TIER_ENDPOINTS, comma-separated)."
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            envvar="MODELSHIP_GATEWAY_ENGINE",
            help="The replicas' engine, ours or vllm (default: deploy.serving.engine): the "
            "health path, the priority order, the cache namespace field and whether streams "
            "fail over (vLLM replicas: never) follow it.",
        ),
    ] = None,
    state: Annotated[
        str | None,
        typer.Option(
            envvar="MODELSHIP_GATEWAY_STATE",
            help="Redis URL of the tenant quota store every gateway replica shares "
            "(default: gateway.state; an environment variable keeps its password out of "
            "pipeline.yaml).",
        ),
    ] = None,
    usage_dir: Annotated[
        Path | None,
        typer.Option(
            envvar="MODELSHIP_GATEWAY_USAGE_DIR",
            help="Append the usage ledger here (the model's usage/ folder on the models "
            "volume, which `modelship usage` reads); each gateway replica writes a file of "
            "its own.",
        ),
    ] = None,
    discover_service: Annotated[
        list[str] | None,
        typer.Option(
            help="A headless Service whose ready pods are the replicas, found in the "
            "Kubernetes API (repeatable; else $MODELSHIP_GATEWAY_DISCOVER_SERVICES, "
            "comma-separated; else gateway.discovery)."
        ),
    ] = None,
    discover_namespace: Annotated[
        str | None,
        typer.Option(
            envvar="MODELSHIP_GATEWAY_DISCOVER_NAMESPACE",
            help="The Services' namespace (default: the gateway pod's own).",
        ),
    ] = None,
    kube_api: Annotated[
        str | None,
        typer.Option(
            envvar="MODELSHIP_GATEWAY_KUBE_API",
            help="The Kubernetes API server's URL (default: in-cluster, with the pod's "
            "service account).",
        ),
    ] = None,
    storage: Annotated[
        Path | None,
        typer.Option(
            "--storage",
            envvar="MODELSHIP_STORAGE",
            help="Follow the release plan of --model on this storage (the models volume): "
            "the canary weight, rollback and promotion `modelship release` writes there, "
            "read every second, over --canary-weight. The gateway holding the leader lease "
            "there judges the canary and probes for drift; its rollbacks go to the plan.",
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            envvar="MODELSHIP_GATEWAY_MODEL",
            help="The model whose release plan this gateway follows (with --storage; "
            "default: the config's model, or the only one on the storage).",
        ),
    ] = None,
    leader_lease_s: Annotated[
        float,
        typer.Option(
            envvar="MODELSHIP_GATEWAY_LEADER_LEASE_S",
            help="With --storage: how long the leader lease on the storage "
            "(models/<slug>/fleet/leader.json) lasts unrenewed; another gateway takes over "
            "that long after the leader dies. Keep it well above the machines' clock skew.",
            min=1.0,
        ),
    ] = 15.0,
    host: Annotated[str | None, typer.Option(help="Interface (default: gateway.host).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: gateway.port).")] = None,
) -> None:
    """Run only the gateway, in front of replicas given by address or found in the
    Kubernetes API (the pods behind headless Services)."""
    from modelship.fleet.standalone import (
        GatewaySetupError,
        PlanSource,
        StandaloneGateway,
        StaticReplicas,
    )
    from modelship.gateway.config import DiscoveryConfig
    from modelship.gateway.launcher import run_gateway

    plan = None
    if storage is not None or model is not None:
        config, store, slug = model_context(config_path, storage, model)
        plan = PlanSource(store, slug)
    else:
        config = load_config(config_path)
    services = discover_service or _split(os.environ.get("MODELSHIP_GATEWAY_DISCOVER_SERVICES"))
    discovery = None
    if services:
        discovery = DiscoveryConfig(services=services, namespace=discover_namespace,
                                    api_server=kube_api)  # fmt: skip
    elif config.gateway.discovery is not None and (discover_namespace or kube_api):
        update = {"namespace": discover_namespace, "api_server": kube_api}
        update = {key: value for key, value in update.items() if value}
        discovery = config.gateway.discovery.model_copy(update=update)
    weight = canary_weight
    if weight is None:
        weight = int(os.environ.get("MODELSHIP_GATEWAY_CANARY_WEIGHT", "0") or 0)
    replicas = StaticReplicas(
        stable=endpoint or _split(os.environ.get("MODELSHIP_GATEWAY_ENDPOINTS")),
        canary=canary_endpoint or _split(os.environ.get("MODELSHIP_GATEWAY_CANARY_ENDPOINTS")),
        canary_weight=weight,
        tier_endpoints=tier_endpoint or _split(os.environ.get("MODELSHIP_GATEWAY_TIER_ENDPOINTS")),
        engine=engine,
    )
    try:
        key = os.environ.get("MODELSHIP_API_KEY")
        gateway = StandaloneGateway(
            config, replicas, key, state_url=state, discovery=discovery, usage_dir=usage_dir,
            plan=plan, lease_s=leader_lease_s,
        )  # fmt: skip
    except GatewaySetupError as exc:
        fail(str(exc), CONFIG_EXIT_CODE)
    setup_logging(config.log_format)
    host, port = host or config.gateway.host, port or config.gateway.port
    run_gateway(gateway.app(), gateway.service, host, port, config.serve.grace_period_s)


@app.command()
def usage(
    since: Annotated[
        str, typer.Option(help="A duration back from now (30m, 2h, 7d) or an ISO 8601 time.")
    ] = "24h",
    as_json: Annotated[bool, typer.Option("--json", help="The rows as JSON.")] = False,
    config_path: ConfigOption = None,
    model: ModelOption = None,
    storage: ConfigStorageOption = None,
) -> None:
    """Requests, tokens and cost per tenant, model and variant, from the gateway's usage
    ledger on storage."""
    import json

    from rich.table import Table

    from modelship.gateway.cost import USAGE_DIR, parse_since, read_usage, summarize

    config, store, slug = model_context(config_path, storage, model)
    try:
        start = parse_since(since)
    except ValueError as exc:
        fail(str(exc), CONFIG_EXIT_CODE)
    rows = summarize(read_usage(store.model_dir(slug) / USAGE_DIR, start))
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print(f"no requests since {start.isoformat(timespec='seconds')}")
        return
    currency = config.gateway.cost.currency
    table = Table(
        "tenant", "model", "variant", "requests", "refused", "input tokens", "output tokens",
        f"cost ({currency})", title=f"usage of {slug} since {start.isoformat(timespec='seconds')}",
    )  # fmt: skip
    for row in rows:
        table.add_row(
            row["tenant"], "(not served)" if row["model"] == "unknown" else row["model"],
            row["variant"], str(row["requests"]), str(row["refused_requests"]),
            str(row["input_tokens"]), str(row["output_tokens"]), _cost_cell(row),
        )  # fmt: skip
    console.print(table)
    unpriced = sorted({row["variant"] for row in rows if row["unpriced_requests"]})
    if unpriced:
        console.print(
            f"unpriced variants: {', '.join(unpriced)}; prices come from pipeline.yaml's "
            "gateway.cost (variants.NAME.input_per_1k/output_per_1k, or replica_hour to "
            "derive them from select's measurements)",
            markup=False, highlight=False,
        )  # fmt: skip
    if any(row["refused_requests"] for row in rows):
        console.print("refused requests are counted, never billed: their tokens are not recorded")


def _cost_cell(row: dict) -> str:
    """The priced requests' cost; requests to a variant with no price are named, not 0."""
    unpriced, requests = row["unpriced_requests"], row["requests"]
    if unpriced == requests:
        return "unpriced"
    cost = f"{row['cost']:.4f}"
    return cost + (f" + {unpriced} unpriced" if unpriced else "")


@release_app.command("canary")
def canary(
    release: Annotated[int, typer.Option(help="The release to try.")],
    weight: Annotated[int, typer.Option(help="Percent of traffic (sticky per session).")] = 10,
    config_path: ConfigOption = None,
    model: ModelOption = None,
    storage: ConfigStorageOption = None,
) -> None:
    """Send WEIGHT percent of traffic to RELEASE; a running `modelship up` and every
    `modelship gateway --storage` follow."""
    from modelship.release.traffic import start_canary

    _, store, slug = model_context(config_path, storage, model)
    try:
        start_canary(store, slug, release, weight)
    except (PipelineError, StorageError) as exc:
        fail(str(exc), exit_code(exc))
    production = store.production_release(slug)
    console.print(f"canary: release {release} takes {weight}% (stable: release {production})")


@release_app.command("promote")
def promote(
    config_path: ConfigOption = None, model: ModelOption = None, storage: ConfigStorageOption = None
) -> None:
    """Make the canary production; its replicas become the stable ones."""
    from modelship.release.traffic import promote_canary

    _, store, slug = model_context(config_path, storage, model)
    try:
        before, after = promote_canary(store, slug)
    except (PipelineError, StorageError) as exc:
        fail(str(exc), exit_code(exc))
    console.print(f"production: release {before} -> release {after}")


@release_app.command("rollback")
def rollback(
    config_path: ConfigOption = None, model: ModelOption = None, storage: ConfigStorageOption = None
) -> None:
    """End the canary: all traffic back to production."""
    from modelship.release.traffic import end_canary

    _, store, slug = model_context(config_path, storage, model)
    try:
        ended = end_canary(store, slug, "rolled back by an operator")
    except (PipelineError, StorageError) as exc:
        fail(str(exc), exit_code(exc))
    if ended is None:
        fail("no canary is running (to point production at an older release: "
             "`modelship rollback`)")  # fmt: skip
    console.print(f"canary release {ended} rolled back; all traffic to production")


@release_app.command("status")
def status(
    config_path: ConfigOption = None, model: ModelOption = None, storage: ConfigStorageOption = None
) -> None:
    """Production, the canary and the release history."""
    from modelship.release.traffic import read_traffic

    _, store, slug = model_context(config_path, storage, model)
    try:
        plan = read_traffic(store, slug)
    except (PipelineError, StorageError) as exc:
        fail(str(exc), exit_code(exc))
    production = store.production_release(slug)
    if production is None:
        releases = ", ".join(map(str, store.releases(slug)))
        fix = (
            f"releases: {releases}; `modelship rollback --to N` makes one production"
            if releases
            else f"{slug} has no release yet: `modelship select` publishes one"
        )
        console.print(f"production: none ({fix})")
    else:
        console.print(f"production: release {production}")
    if plan.canary is None:
        console.print("canary: none")
    else:
        console.print(f"canary: release {plan.canary.release} at {plan.canary.weight}%")
    for event in plan.events[-10:]:
        reason = f" ({event['reason']})" if event.get("reason") else ""
        console.print(f"  {event['at']} {event['action']} release {event['release']}{reason}")


@release_app.command("show")
def show(
    release: Annotated[
        int | None, typer.Argument(help="Release number (default: production).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The whole record as JSON.")] = False,
    config_path: ConfigOption = None,
    model: ModelOption = None,
    storage: ConfigStorageOption = None,
) -> None:
    """One release's provenance: source and checksums, recipes, measurements with
    intervals, gates, why it won, and its canary / promotion history."""
    import json

    from modelship.release.traffic import release_record

    _, store, slug = model_context(config_path, storage, model)
    number = release if release is not None else store.production_release(slug)
    if number is None:
        fail(f"{slug} has no production release; name one: modelship release show N")
    try:
        record = release_record(store, slug, number)
    except (PipelineError, StorageError) as exc:
        fail(str(exc), exit_code(exc))
    if as_json:
        typer.echo(json.dumps(record, indent=2))
        return
    _print_record(record)


def _recipe_text(recipe: dict) -> str:
    """A variant's weights in words: "gptq, 4-bit weights in groups of 128", "fp16, float16
    weights" (a recipe with no bit width keeps its dtype)."""
    scheme = recipe.get("scheme", "?")
    if recipe.get("bits") is None:
        return f"{scheme}, {recipe.get('dtype') or 'unquantized'} weights"
    groups = f" in groups of {recipe['group_size']}" if recipe.get("group_size") else ""
    return f"{scheme}, {recipe['bits']}-bit weights{groups}"


def _print_record(record: dict) -> None:
    state = "production" if record["production"] else "not production"
    if record.get("canary"):
        state = f"canary at {record['canary']['weight']}%"
    _say(
        f"release {record['release']} of {record['model']}: {record.get('variant', '?')} ({state})"
    )
    if "note" in record:
        _say(f"  {record['note']}")
    if "published_at" in record:
        _say(f"  published {record['published_at']} by {record['published_by']}")
    source = record.get("source") or {}
    if source:
        _say(f"  source: {source.get('source')} @ {source.get('revision') or 'local'}")
    for name, variant in (record.get("variants") or {}).items():
        recipe = variant.get("recipe") or {}
        tools = ", ".join(
            f"{k} {v}" for k, v in sorted((variant.get("tool_versions") or {}).items())
        )
        _say(f"  variant {name}: {_recipe_text(recipe)}" + (f"; {tools}" if tools else ""))
    selection = record.get("selection") or {}
    for line in selection.get("why", []):
        _say(f"  {line.replace('**', '')}")
    for name, m in (record.get("measurements") or {}).items():
        serving = m.get("serving") or {}
        parts = []
        if m.get("quality_share") is not None:
            low, high = m.get("quality_share_ci95") or (None, None)
            interval = "" if low is None else f" [{low:.1%}, {high:.1%}]"
            parts.append(f"quality {m['quality_share']:.1%}{interval}")
        for metric, scale, unit in (("ttft_s", 1e3, "ms TTFT"), ("tpot_s", 1e3, "ms/token"),
                                    ("throughput_tok_s", 1, "tok/s")):  # fmt: skip
            if metric in serving:
                value, ci = serving[metric]["mean"], serving[metric]["ci95"]
                noise = "" if ci is None else f" +/- {ci * scale:.1f}"
                parts.append(f"{value * scale:.1f}{noise} {unit}")
        if m.get("load_error"):
            parts.append(f"failed: {m['load_error']}")
        _say(f"  measured {name}: {', '.join(parts) or '-'}")
    for event in record.get("history", []):
        extra = "".join(
            f" {key}={event[key]}" for key in ("weight", "previous", "reason") if key in event
        )
        _say(f"  {event['at']} {event['action']} by {event.get('by', '?')}{extra}")


def _say(text: str) -> None:
    console.print(text, markup=False, highlight=False)  # error texts hold brackets
