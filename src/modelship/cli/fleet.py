"""`modelship up`, `modelship gateway` and `modelship release ...`: the serving fleet."""

from __future__ import annotations

import os
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
    host: Annotated[str | None, typer.Option(help="Interface (default: gateway.host).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: gateway.port).")] = None,
) -> None:
    """Run only the gateway, in front of replicas given by address (e.g. Kubernetes)."""
    from modelship.gateway.app import create_gateway_app
    from modelship.gateway.canary import Track
    from modelship.gateway.launcher import run_gateway
    from modelship.gateway.pool import EndpointPool, static_upstreams
    from modelship.gateway.service import GatewayService

    config = load_config(config_path)
    stable = endpoint or _split(os.environ.get("MODELSHIP_GATEWAY_ENDPOINTS"))
    canary = canary_endpoint or _split(os.environ.get("MODELSHIP_GATEWAY_CANARY_ENDPOINTS"))
    if not stable:
        fail(
            "no replicas: pass --endpoint URL or set MODELSHIP_GATEWAY_ENDPOINTS",
            CONFIG_EXIT_CODE,
        )
    weight = canary_weight
    if weight is None:
        weight = int(os.environ.get("MODELSHIP_GATEWAY_CANARY_WEIGHT", "0") or 0)
    if canary and not 0 <= weight <= 99:
        fail(f"--canary-weight must be 0..99 (percent), got {weight}", CONFIG_EXIT_CODE)
    pool = EndpointPool(config.gateway.resilience)
    static_upstreams(pool, stable, Track.STABLE, "stable")
    static_upstreams(pool, canary, Track.CANARY, "canary")
    # Clients authenticate as tenants (or with serve.api_key); the replicas may want the
    # service key, which Kubernetes hands the gateway as MODELSHIP_API_KEY.
    upstream_key = os.environ.get("MODELSHIP_API_KEY") or config.serve.api_key
    service = GatewayService(
        config.gateway,
        pool,
        api_key=config.serve.api_key or os.environ.get("MODELSHIP_API_KEY"),
        upstream_api_key=upstream_key,
        canary_weight=weight if canary else 0,
    )
    setup_logging()
    run_gateway(
        create_gateway_app(service),
        service,
        host or config.gateway.host,
        port or config.gateway.port,
        config.serve.grace_period_s,
    )


@release_app.command("canary")
def canary(
    release: Annotated[int, typer.Option(help="The release to try.")],
    weight: Annotated[int, typer.Option(help="Percent of traffic (sticky per session).")] = 10,
    config_path: ConfigOption = None,
    model: ModelOption = None,
    storage: ConfigStorageOption = None,
) -> None:
    """Send WEIGHT percent of traffic to RELEASE; a running `modelship up` follows."""
    from modelship.fleet.releases import start_canary

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
    from modelship.fleet.releases import promote_canary

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
    from modelship.fleet.releases import end_canary

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
    from modelship.fleet.releases import read_traffic

    _, store, slug = model_context(config_path, storage, model)
    try:
        plan = read_traffic(store, slug)
    except (PipelineError, StorageError) as exc:
        fail(str(exc), exit_code(exc))
    console.print(f"production: release {store.production_release(slug)}")
    if plan.canary is None:
        console.print("canary: none")
    else:
        console.print(f"canary: release {plan.canary.release} at {plan.canary.weight}%")
    for event in plan.events[-10:]:
        reason = f" ({event['reason']})" if event.get("reason") else ""
        console.print(f"  {event['at']} {event['action']} release {event['release']}{reason}")
