"""`modelship up`, `modelship gateway` and `modelship release ...`."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated

import typer

from modelship.pipeline.errors import PipelineError
from modelship.storage import STORAGE_ENV, StorageError

release_app = typer.Typer(
    help="Canary releases: send a share of traffic to another release, promote or roll back.",
    no_args_is_help=True,
)

ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="pipeline.yaml (default: built-in defaults, demo model)."),
]
ModelOption = Annotated[str | None, typer.Option(help="Model slug under models/.")]
StorageOption = Annotated[
    Path | None,
    typer.Option("--storage", envvar=STORAGE_ENV, help="Storage root (default: the config's)."),
]


def _logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health check otherwise


def run_up(config, storage, slug: str, host: str | None = None, port: int | None = None) -> None:
    """Gateway + supervisor + replicas of the production release, until SIGTERM/SIGINT."""
    from modelship import cli as base
    from modelship.autoscale.fleet import LocalFleet
    from modelship.gateway.launcher import run_gateway

    try:
        fleet = LocalFleet(config, storage, slug)
    except (PipelineError, StorageError) as exc:
        base.fail(str(exc))
        return
    _logging()
    host = host or config.gateway.host
    port = port or config.gateway.port
    base.console.print(
        f"[green]serving[/] {fleet.served_model_name} at http://{host}:{port}/v1 "
        f"(replica logs: {fleet.log_dir})"
    )
    run_gateway(fleet.app(), fleet.service, host, port, config.serve.grace_period_s)


def up(
    config_path: ConfigOption = None,
    model: ModelOption = None,
    storage: StorageOption = None,
    host: Annotated[str | None, typer.Option(help="Gateway interface.")] = None,
    port: Annotated[int | None, typer.Option(help="Gateway port.")] = None,
) -> None:
    """Serve the production release: gateway + autoscaled replicas (+ canary)."""
    from modelship import cli as base

    config, store, slug = base._model_context(config_path, storage, model)
    run_up(config, store, slug, host, port)


def _split(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


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
    from modelship import cli as base
    from modelship.gateway.app import create_gateway_app
    from modelship.gateway.canary import Track
    from modelship.gateway.launcher import run_gateway
    from modelship.gateway.pool import EndpointPool, static_upstreams
    from modelship.gateway.service import GatewayService

    config = base.load_config(config_path)
    stable = endpoint or _split(os.environ.get("MODELSHIP_GATEWAY_ENDPOINTS"))
    canary = canary_endpoint or _split(os.environ.get("MODELSHIP_GATEWAY_CANARY_ENDPOINTS"))
    if not stable:
        base.fail("no replicas: pass --endpoint URL or set MODELSHIP_GATEWAY_ENDPOINTS", code=2)
    weight = canary_weight
    if weight is None:
        weight = int(os.environ.get("MODELSHIP_GATEWAY_CANARY_WEIGHT", "0") or 0)
    if canary and not 0 <= weight <= 99:
        base.fail(f"--canary-weight must be 0..99 (percent), got {weight}", code=2)
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
    _logging()
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
    storage: StorageOption = None,
) -> None:
    """Send WEIGHT percent of traffic to RELEASE; a running `modelship up` follows."""
    from modelship import cli as base
    from modelship.gateway.traffic import start_canary

    _, store, slug = base._model_context(config_path, storage, model)
    try:
        start_canary(store, slug, release, weight)
    except (PipelineError, StorageError) as exc:
        base.fail(str(exc))
        return
    production = store.production_release(slug)
    base.console.print(f"canary: release {release} takes {weight}% (stable: release {production})")


@release_app.command("promote")
def promote(
    config_path: ConfigOption = None, model: ModelOption = None, storage: StorageOption = None
) -> None:
    """Make the canary production; its replicas become the stable ones."""
    from modelship import cli as base
    from modelship.gateway.traffic import promote_canary

    _, store, slug = base._model_context(config_path, storage, model)
    try:
        before, after = promote_canary(store, slug)
    except (PipelineError, StorageError) as exc:
        base.fail(str(exc))
        return
    base.console.print(f"production: release {before} -> release {after}")


@release_app.command("rollback")
def rollback(
    config_path: ConfigOption = None, model: ModelOption = None, storage: StorageOption = None
) -> None:
    """End the canary: all traffic back to production."""
    from modelship import cli as base
    from modelship.gateway.traffic import end_canary

    _, store, slug = base._model_context(config_path, storage, model)
    try:
        ended = end_canary(store, slug, "rolled back by an operator")
    except (PipelineError, StorageError) as exc:
        base.fail(str(exc))
        return
    if ended is None:
        base.fail("no canary is running (to point production at an older release: "
                  "`modelship rollback`)")  # fmt: skip
    base.console.print(f"canary release {ended} rolled back; all traffic to production")


@release_app.command("status")
def status(
    config_path: ConfigOption = None, model: ModelOption = None, storage: StorageOption = None
) -> None:
    """Production, the canary and the release history."""
    from modelship import cli as base
    from modelship.gateway.traffic import read_traffic

    _, store, slug = base._model_context(config_path, storage, model)
    try:
        plan = read_traffic(store, slug)
    except (PipelineError, StorageError) as exc:
        base.fail(str(exc))
        return
    base.console.print(f"production: release {store.production_release(slug)}")
    if plan.canary is None:
        base.console.print("canary: none")
    else:
        base.console.print(f"canary: release {plan.canary.release} at {plan.canary.weight}%")
    for event in plan.events[-10:]:
        reason = f" ({event['reason']})" if event.get("reason") else ""
        base.console.print(f"  {event['at']} {event['action']} release {event['release']}{reason}")


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("gateway")(gateway)
    app.add_typer(release_app, name="release")
