"""Names, labels and in-cluster paths shared by every rendered object.

Rendering must not touch the network or the disk, so the model's slug is computed here from
the source text alone, with the same rules `pipeline.acquire.resolve_source` applies (which
needs the file system to tell a folder from a Hub id).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from modelship.storage import slugify

# `pipeline.acquire.DEMO_SLUG`, not imported: this module is loaded with every config, and
# acquire pulls in the Hub client (a test keeps the two equal).
DEMO_SLUG = "smollm2-135m-instruct"
DATA_ROOT = "/data"  # the PVC's mount point: the storage root of every stage
CONFIG_DIR = "/etc/modelship"
CONFIG_FILE = "pipeline.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
APP = "modelship"
# Object names get suffixes up to 15 characters (`-engine-canary`); Knative adds its own
# (`-predictor-00001`) and host names are limited to 63 characters per label.
MAX_NAME_LENGTH = 40
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # Service names
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # namespaces, PVCs


def model_slug(source: str, name: str | None = None) -> str:
    """The folder name under `models/` that `modelship acquire SOURCE --name NAME` will use."""
    if name:
        return slugify(name)
    text = source.strip()
    if text == "demo":
        return DEMO_SLUG
    path = PurePosixPath(text)
    if text.endswith(".gguf"):
        return slugify(path.stem)
    if text.startswith((".", "/", "~")):
        return slugify(path.name)
    return slugify(text)


def dns_name(slug: str) -> str:
    """A DNS-1035 label from a slug: what Services and InferenceServices may be called."""
    name = re.sub(r"[^a-z0-9-]+", "-", slug.lower())
    name = re.sub(r"-{2,}", "-", name).strip("-")
    if not name or not name[0].isalpha():
        name = f"m-{name}".rstrip("-")
    return name[:MAX_NAME_LENGTH].rstrip("-")


def labels(instance: str, component: str) -> dict[str, str]:
    """Recommended labels; `instance` + `component` also select pods, so keep them stable."""
    return {
        "app.kubernetes.io/name": APP,
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": APP,
    }


def selector(instance: str, component: str) -> dict[str, str]:
    """The immutable subset of `labels` that Deployments and Services select on."""
    return {
        "app.kubernetes.io/name": APP,
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": component,
    }


def model_path(slug: str, release: int | None = None) -> str:
    """Where an engine reads the model: `production` (switched by select) or a fixed release."""
    tail = "production" if release is None else f"releases/{release}"
    return f"{DATA_ROOT}/models/{slug}/{tail}"


def variant_path(slug: str, variant: str) -> str:
    """An optimized variant's folder: what a cheaper tier's engines read."""
    return f"{DATA_ROOT}/models/{slug}/optimized/{variant}"


def metadata(name: str, namespace: str, object_labels: dict[str, str]) -> dict[str, object]:
    return {"name": name, "namespace": namespace, "labels": dict(object_labels)}
