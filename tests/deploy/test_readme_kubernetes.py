"""The README's Kubernetes commands work as written against what `deploy render` writes.

The README's first bash block under "## Kubernetes" is read line by line: the modelship
commands run through the CLI (in a folder holding `pipeline.yaml`, the shipped example as
the README's configuration section says to copy it); each kubectl and argo command is
checked against the rendered files: the files it names exist, its namespace is created
before it is used, and the objects it waits for are of the kind and in the namespace it
names. A command this test cannot check fails it, so the block cannot grow unchecked.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from k8s_tools import REPO_ROOT, SCHEMA_DIR
from typer.testing import CliRunner

from modelship.cli import app

README = REPO_ROOT / "README.md"
EXAMPLE = REPO_ROOT / "pipeline.example.yaml"
# kubectl's names for the kinds the README may wait for.
KINDS = {
    "inferenceservice": "InferenceService",
    "isvc": "InferenceService",
    "deploy": "Deployment",
    "deployment": "Deployment",
    "pvc": "PersistentVolumeClaim",
    "hpa": "HorizontalPodAutoscaler",
    "svc": "Service",
    "workflow": "Workflow",
}


def section_block(text: str, heading: str, kind: str = "bash") -> str:
    """The first ```kind block of the section whose heading starts with `heading`."""
    section = re.search(rf"^#+ {re.escape(heading)}.*?(?=^## |\Z)", text, re.S | re.M)
    assert section, f"no section '{heading}'"
    block = re.search(rf"```{kind}\n(.*?)```", section.group(0), re.S)
    assert block, f"the section '{heading}' has no {kind} block"
    return block.group(1)


def commands(block: str) -> list[str]:
    lines = [line.split(" #")[0].strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def kubernetes_block(text: str) -> list[str]:
    """The commands of the first bash block in the README's "## Kubernetes" section."""
    return commands(section_block(text, "Kubernetes"))


@dataclass
class Cluster:
    """What the commands so far have put in the (imagined) cluster."""

    folder: Path
    namespaces: set[str] = field(default_factory=set)
    objects: list[dict] = field(default_factory=list)

    def read(self, name: str) -> list[dict]:
        path = self.folder / name
        assert path.is_file(), f"{name}: the render wrote no such file"
        return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]

    def apply(self, docs: list[dict]) -> None:
        for doc in docs:
            if doc["kind"] == "Namespace":
                self.namespaces.add(doc["metadata"]["name"])
                continue
            namespace = doc["metadata"].get("namespace")
            assert namespace in self.namespaces, (
                f"{doc['kind']}/{doc['metadata'].get('name')}: namespace {namespace} "
                "is not created by any earlier command"
            )
            self.objects.append(doc)

    def find(self, kind: str, namespace: str, name: str | None) -> list[dict]:
        return [
            obj
            for obj in self.objects
            if obj["kind"] == kind
            and obj["metadata"].get("namespace") == namespace
            and name in (None, obj["metadata"].get("name"))
        ]


def namespace_flag(args: list[str]) -> str:
    assert "-n" in args, f"{shlex.join(args)}: name the namespace with -n"
    return args[args.index("-n") + 1]


def run_modelship(args: list[str], cwd: Path) -> Path | None:
    """Run one `modelship ...` line; the folder it rendered into, if it rendered."""
    if args[:2] == ["deploy", "validate"] and not (SCHEMA_DIR / "strict").is_dir():
        return None  # the schemas are data beside the repository; test_deploy_cli covers it
    if args[:2] == ["deploy", "validate"]:
        args = [*args, "--schemas", str(SCHEMA_DIR)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"modelship {shlex.join(args)}:\n{result.output}"
    if args[:2] == ["deploy", "render"]:
        return cwd / args[args.index("--out") + 1]
    return None


def check(line: str, cwd: Path, cluster: Cluster | None) -> Cluster | None:
    args = shlex.split(line)
    program, args = Path(args[0]).name, args[1:]
    if program == "modelship":
        out = run_modelship(args, cwd)
        return Cluster(out) if out is not None else cluster
    assert cluster is not None, f"{line}: comes before `modelship deploy render`"
    if program == "kubectl" and args[:2] == ["create", "namespace"]:
        cluster.namespaces.add(args[2])
    elif program == "kubectl" and args[0] == "apply":
        cluster.apply(cluster.read(Path(args[args.index("-f") + 1]).name))
    elif program == "argo" and args[0] == "submit":
        namespace = namespace_flag(args)
        assert namespace in cluster.namespaces, f"{line}: namespace {namespace} does not exist"
        (workflow,) = cluster.read(Path(args[-1]).name)
        assert workflow["kind"] == "Workflow"
        rendered_namespace = workflow["metadata"].get("namespace")
        assert rendered_namespace in (None, namespace), (
            f"{line}: the Workflow is rendered for namespace {rendered_namespace}"
        )
        account = workflow["spec"].get("serviceAccountName")
        assert account is None or cluster.find("ServiceAccount", namespace, account), (
            f"{line}: the Workflow runs as {account}, not created in {namespace}"
        )
        # Its deploy step applies serving.yaml into the namespace.
        cluster.apply(cluster.read("serving.yaml"))
    elif program == "kubectl" and "get" in args:
        namespace = namespace_flag(args)
        rest = [arg for arg in args[args.index("get") + 1 :] if not arg.startswith("-")]
        kind = KINDS[rest[0]]
        name = rest[1] if len(rest) > 1 else None
        assert cluster.find(kind, namespace, name), f"{line}: no {kind} {name} in {namespace}"
    else:
        pytest.fail(f"README Kubernetes block: `{line}` is not a command this test can check")
    return cluster


def test_the_readme_kubernetes_commands_work_on_the_rendered_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pipeline.yaml").write_text(EXAMPLE.read_text())
    monkeypatch.chdir(tmp_path)
    commands = kubernetes_block(README.read_text())
    assert any("deploy render" in line for line in commands)
    assert any(line.startswith("argo submit") for line in commands)
    cluster = None
    for line in commands:
        cluster = check(line, tmp_path, cluster)
    assert cluster is not None and cluster.objects


def test_the_check_catches_the_old_sequence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The README before the fix: a namespace the render does not use.
    (tmp_path / "pipeline.yaml").write_text(EXAMPLE.read_text())
    monkeypatch.chdir(tmp_path)
    cluster = check(
        "modelship deploy render --config pipeline.yaml --out k8s --serving kserve", tmp_path, None
    )
    check("kubectl create namespace llm", tmp_path, cluster)
    check("kubectl apply -f k8s/cluster.yaml", tmp_path, cluster)
    with pytest.raises(AssertionError, match="rendered for namespace modelship"):
        check("argo submit -n llm --watch k8s/workflow.yaml", tmp_path, cluster)


def test_the_operator_guide_sequence_works_on_its_own_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/kubernetes.md: section 2's config, section 3's renders, section 4's commands."""
    guide = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    (tmp_path / "pipeline.yaml").write_text(section_block(guide, "2. Configure", "yaml"))
    monkeypatch.chdir(tmp_path)
    cluster = None
    for line in commands(section_block(guide, "3. Render")) + commands(
        section_block(guide, "4. Apply")
    ):
        cluster = check(line, tmp_path, cluster)
    assert cluster is not None and "llm" in cluster.namespaces
