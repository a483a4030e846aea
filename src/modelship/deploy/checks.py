"""Checks a JSON schema cannot make, run on every render before anything is written.

The API server (and its controllers) reject or silently break objects that pass their
schema: a selector that matches no pod template, a quantity that does not parse, a limit
below its request, a volume claim or ConfigMap that does not exist, a probe on a port the
container does not expose, an autoscaler aimed at a missing Deployment. Each check takes the
rendered objects and returns the problems found, never raising, so a test sees them all.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from modelship.deploy.quantity import QuantityError, parse_quantity

Json = dict[str, Any]
_WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
_PROBES = ("readinessProbe", "livenessProbe", "startupProbe")


@dataclass(frozen=True)
class CheckError:
    """One problem: which object, where in it, what is wrong."""

    object: str  # Kind/name
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.object}: {self.path}: {self.message}"


@dataclass(frozen=True)
class PodView:
    """A pod spec found inside an object (a Deployment's template, a Workflow step...)."""

    owner: str
    path: str
    spec: Json  # has `containers` and `volumes` like a PodSpec
    labels: dict[str, str] | None  # None where the pod's labels are not in the object


def object_id(obj: Json) -> str:
    meta = obj.get("metadata", {})
    return f"{obj.get('kind')}/{meta.get('name') or meta.get('generateName', '?')}"


def pod_views(obj: Json) -> list[PodView]:
    """Every pod spec an object will create, with its labels where known."""
    owner, kind, spec = object_id(obj), obj.get("kind"), obj.get("spec", {})
    if kind in _WORKLOADS:
        template = spec.get("template", {})
        labels = template.get("metadata", {}).get("labels", {})
        return [PodView(owner, "spec.template.spec", template.get("spec", {}), labels)]
    if kind == "Pod":
        return [PodView(owner, "spec", spec, obj.get("metadata", {}).get("labels", {}))]
    if kind == "InferenceService":
        predictor = spec.get("predictor", {})
        return [PodView(owner, "spec.predictor", predictor, predictor.get("labels", {}))]
    if kind == "Workflow":
        shared = spec.get("volumes", [])
        views = []
        for index, template in enumerate(spec.get("templates", [])):
            if "container" in template:
                pod = {
                    "containers": [template["container"]],
                    "volumes": shared + template.get("volumes", []),
                }
                views.append(PodView(owner, f"spec.templates[{index}]", pod, None))
        return views
    return []


def containers(view: PodView) -> Iterator[tuple[str, Json]]:
    for field in ("initContainers", "containers"):
        for index, container in enumerate(view.spec.get(field, [])):
            yield f"{view.path}.{field}[{index}]", container


def _by_kind(objects: list[Json], kind: str) -> list[Json]:
    return [obj for obj in objects if obj.get("kind") == kind]


def _names(objects: list[Json], kind: str) -> set[str]:
    return {obj["metadata"]["name"] for obj in _by_kind(objects, kind)}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def check_selectors(objects: list[Json]) -> list[CheckError]:
    """Workload selectors match their own template; Services and PDBs select some pod."""
    errors = []
    pods = [view for obj in objects for view in pod_views(obj) if view.labels is not None]
    for obj in objects:
        kind, spec = obj.get("kind"), obj.get("spec", {})
        if kind in _WORKLOADS:
            match = spec.get("selector", {}).get("matchLabels", {})
            labels = spec.get("template", {}).get("metadata", {}).get("labels", {})
            if not match:
                errors.append(CheckError(object_id(obj), "spec.selector", "empty selector"))
            elif not _matches(match, labels):
                errors.append(
                    CheckError(
                        object_id(obj),
                        "spec.selector.matchLabels",
                        f"{match} does not match the pod template labels {labels}",
                    )
                )
        elif kind in ("Service", "PodDisruptionBudget"):
            path = "spec.selector" if kind == "Service" else "spec.selector.matchLabels"
            match = spec.get("selector", {})
            match = match if kind == "Service" else match.get("matchLabels", {})
            if match and not any(_matches(match, view.labels or {}) for view in pods):
                errors.append(CheckError(object_id(obj), path, f"{match} selects no pod"))
    return errors


def _resource_items(view: PodView) -> Iterator[tuple[str, str, str, Any]]:
    """(path, section, resource name, value) for every request and limit of every container."""
    for path, container in containers(view):
        for section in ("requests", "limits"):
            for name, value in container.get("resources", {}).get(section, {}).items():
                yield f"{path}.resources.{section}", section, name, value


def check_quantities(objects: list[Json]) -> list[CheckError]:
    """Every request, limit and storage size parses; extended resources are whole numbers."""
    errors = []
    for obj in objects:
        items = [item for view in pod_views(obj) for item in _resource_items(view)]
        if obj.get("kind") == "PersistentVolumeClaim":
            requests = obj.get("spec", {}).get("resources", {}).get("requests", {})
            items += [("spec.resources.requests", "requests", k, v) for k, v in requests.items()]
        for path, _section, name, value in items:
            try:
                amount = parse_quantity(value)
            except QuantityError as exc:
                errors.append(CheckError(object_id(obj), f"{path}.{name}", str(exc)))
                continue
            if amount < 0:
                errors.append(CheckError(object_id(obj), f"{path}.{name}", f"{value} < 0"))
            if "/" in name and not name.startswith("hugepages") and amount != int(amount):
                message = f"{value}: an extended resource must be a whole number"
                errors.append(CheckError(object_id(obj), f"{path}.{name}", message))
    return errors


def check_limits(objects: list[Json]) -> list[CheckError]:
    """limits >= requests; extended resources (GPUs) cannot be overcommitted at all."""
    errors = []
    for obj in objects:
        for view in pod_views(obj):
            for path, container in containers(view):
                resources = container.get("resources", {})
                requests, limits = resources.get("requests", {}), resources.get("limits", {})
                for name, request in requests.items():
                    if name not in limits:
                        if "/" in name:
                            message = f"extended resource {name} needs a limit"
                            errors.append(CheckError(object_id(obj), path, message))
                        continue
                    try:
                        low, high = parse_quantity(request), parse_quantity(limits[name])
                    except QuantityError:
                        continue  # reported by check_quantities
                    if high < low:
                        message = f"{name} limit {limits[name]} < request {request}"
                        errors.append(CheckError(object_id(obj), f"{path}.resources", message))
                    elif "/" in name and high != low:
                        message = f"{name} request {request} != limit {limits[name]}"
                        errors.append(CheckError(object_id(obj), f"{path}.resources", message))
    return errors


def check_volumes(objects: list[Json]) -> list[CheckError]:
    """Claims and ConfigMaps a pod mounts exist in the render; every mount has its volume."""
    errors = []
    claims, config_maps = _names(objects, "PersistentVolumeClaim"), _names(objects, "ConfigMap")
    for obj in objects:
        for view in pod_views(obj):
            volumes = view.spec.get("volumes", [])
            for index, volume in enumerate(volumes):
                path = f"{view.path}.volumes[{index}]"
                claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                if claim is not None and claim not in claims:
                    message = f"PersistentVolumeClaim {claim!r} is not in the render"
                    errors.append(CheckError(object_id(obj), path, message))
                config_map = volume.get("configMap", {}).get("name")
                if config_map is not None and config_map not in config_maps:
                    message = f"ConfigMap {config_map!r} is not in the render"
                    errors.append(CheckError(object_id(obj), path, message))
            names = {volume.get("name") for volume in volumes}
            for path, container in containers(view):
                for mount in container.get("volumeMounts", []):
                    if mount.get("name") not in names:
                        message = f"mounts volume {mount.get('name')!r}, which the pod lacks"
                        errors.append(CheckError(object_id(obj), path, message))
    return errors


def _probe_port(probe: Json) -> int | str | None:
    for handler in ("httpGet", "tcpSocket", "grpc"):
        if handler in probe:
            return probe[handler].get("port")
    return None


def check_probe_ports(objects: list[Json]) -> list[CheckError]:
    """A probe's port (by name or number) is one the container declares."""
    errors = []
    for obj in objects:
        for view in pod_views(obj):
            for path, container in containers(view):
                ports = container.get("ports", [])
                names = {port.get("name") for port in ports if port.get("name")}
                numbers = {port.get("containerPort") for port in ports}
                for probe_name in _PROBES:
                    port = _probe_port(container.get(probe_name, {}))
                    if port is None:
                        continue
                    known = names if isinstance(port, str) else numbers
                    if port not in known:
                        message = f"port {port!r} is not a port of the container"
                        errors.append(CheckError(object_id(obj), f"{path}.{probe_name}", message))
    return errors


def check_scale_targets(objects: list[Json]) -> list[CheckError]:
    """An HPA or ScaledObject scales a Deployment that is in the render."""
    errors = []
    deployments = _names(objects, "Deployment")
    for obj in _by_kind(objects, "HorizontalPodAutoscaler") + _by_kind(objects, "ScaledObject"):
        target = obj.get("spec", {}).get("scaleTargetRef", {})
        if (
            target.get("kind", "Deployment") == "Deployment"
            and target.get("name") not in deployments
        ):
            message = f"Deployment {target.get('name')!r} is not in the render"
            errors.append(CheckError(object_id(obj), "spec.scaleTargetRef", message))
    return errors


def check_service_ports(objects: list[Json]) -> list[CheckError]:
    """A Service's ports have distinct names and numbers (the API server refuses repeats)."""
    errors = []
    for obj in _by_kind(objects, "Service"):
        ports = obj.get("spec", {}).get("ports", [])
        for field in ("name", "port"):
            values = [port.get(field) for port in ports]
            repeated = sorted({str(v) for v in values if v is not None and values.count(v) > 1})
            if repeated:
                message = f"repeated port {field}: {', '.join(repeated)}"
                errors.append(CheckError(object_id(obj), "spec.ports", message))
    return errors


def check_configs(objects: list[Json]) -> list[CheckError]:
    """A ConfigMap's pipeline.yaml loads as a config, and every `modelship serve` container
    names a device the engine takes (a hand-edited render fails here, not in the pod)."""
    from modelship.config import ConfigError, ModelshipConfig
    from modelship.deploy.names import CONFIG_FILE
    from modelship.engine.devices import check_device_name

    errors = []
    for obj in _by_kind(objects, "ConfigMap"):
        text = (obj.get("data") or {}).get(CONFIG_FILE)
        if text is None:
            continue
        try:
            ModelshipConfig.from_dict(yaml.safe_load(text) or {}, CONFIG_FILE)
        except (ConfigError, yaml.YAMLError) as exc:
            errors.append(CheckError(object_id(obj), f"data.{CONFIG_FILE}", str(exc)))
    for obj in objects:
        for view in pod_views(obj):
            for where, container in containers(view):
                args = container.get("args") or []
                if container.get("command") != ["modelship"] or args[:1] != ["serve"]:
                    continue
                for flag, value in itertools.pairwise(args):
                    if flag != "--device":
                        continue
                    try:
                        check_device_name(value)
                    except ValueError as exc:
                        errors.append(CheckError(view.owner, f"{where}.args", str(exc)))
    return errors


CHECKS: tuple[Callable[[list[Json]], list[CheckError]], ...] = (
    check_selectors,
    check_quantities,
    check_limits,
    check_volumes,
    check_probe_ports,
    check_scale_targets,
    check_service_ports,
    check_configs,
)


def check_objects(objects: list[Json]) -> list[CheckError]:
    """All problems in a render (empty when every check passes)."""
    return [error for check in CHECKS for error in check(objects)]
