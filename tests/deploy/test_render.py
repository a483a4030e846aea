"""Every serving combination renders, passes the strict schemas and the cross-checks."""

from __future__ import annotations

import copy
import itertools
import json
import re
from pathlib import Path

import pytest
import yaml
from k8s_tools import by_kind, config_for, one

from modelship.config import ModelshipConfig
from modelship.deploy.checks import check_objects
from modelship.deploy.render import render, write_rendered
from modelship.deploy.validate import validate_objects
from modelship.deploy.workflow import ROLLOUT_ANNOTATION

SERVING = [("kserve", "hpa"), ("deployment", "hpa"), ("deployment", "keda")]
MATRIX = [
    (serving, autoscaler, gpu, canary)
    for (serving, autoscaler), gpu, canary in itertools.product(
        SERVING, ["cpu", "gpu", "vllm"], [False, True]
    )
]
NAME = "smollm2-135m-instruct"


def ids(point: tuple[str, str, str, bool]) -> str:
    serving, autoscaler, gpu, canary = point
    kind = "kserve" if serving == "kserve" else f"deployment-{autoscaler}"
    return f"{kind}-{gpu}" + ("-canary" if canary else "")


@pytest.mark.parametrize("point", MATRIX, ids=ids)
def test_every_combination_is_valid(point: tuple[str, str, str, bool], schema_dir: Path) -> None:
    serving, autoscaler, gpu, canary = point
    objects = render(config_for(serving, autoscaler, gpu, canary)).objects

    assert validate_objects(objects, schema_dir) == []
    assert check_objects(objects) == []
    kinds = {obj["kind"] for obj in objects}
    assert {"PersistentVolumeClaim", "ConfigMap", "Workflow", "PodDisruptionBudget"} <= kinds
    if serving == "kserve":
        assert "InferenceService" in kinds and "Deployment" not in kinds
    else:
        autoscaler_kind = "ScaledObject" if autoscaler == "keda" else "HorizontalPodAutoscaler"
        assert autoscaler_kind in kinds and "InferenceService" not in kinds
        assert len(by_kind(objects, "Deployment")) == (3 if canary else 2)


def engine_pod(objects: list[dict], serving: str) -> tuple[dict, dict]:
    """(pod-spec-like dict, engine container) of the stable engine."""
    if serving == "kserve":
        predictor = one(objects, "InferenceService")["spec"]["predictor"]
        return predictor, predictor["containers"][0]
    pod = one(objects, "Deployment", f"{NAME}-engine")["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


@pytest.mark.parametrize("serving", ["kserve", "deployment"])
def test_gpu_serving_asks_for_gpus_on_gpu_nodes(serving: str) -> None:
    objects = render(config_for(serving, gpu="gpu")).objects
    pod, container = engine_pod(objects, serving)

    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in container["resources"].get("requests", {})
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    expression = terms["nodeSelectorTerms"][0]["matchExpressions"][0]
    assert expression == {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert container["args"][container["args"].index("--device") + 1] == "cuda"


@pytest.mark.parametrize("serving", ["kserve", "deployment"])
def test_tensor_parallel_size_sets_gpus_per_pod_and_the_flag(serving: str) -> None:
    config = config_for(serving, gpu="gpu")  # gpu.count 1: raised to the 2 ranks
    engine = config.serve.engine.model_copy(update={"tensor_parallel_size": 2})
    config = config.model_copy(update={"serve": config.serve.model_copy(update={"engine": engine})})
    _, container = engine_pod(render(config).objects, serving)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "2"


def test_cpu_serving_has_no_gpu_anything() -> None:
    objects = render(config_for("deployment")).objects
    pod, _ = engine_pod(objects, "deployment")
    assert "affinity" not in pod and "tolerations" not in pod
    assert "nvidia.com/gpu" not in json.dumps(objects)


@pytest.mark.parametrize("serving", ["kserve", "deployment"])
def test_vllm_engine_serves_the_production_folder(serving: str) -> None:
    objects = render(config_for(serving, gpu="vllm")).objects
    _, container = engine_pod(objects, serving)

    assert container["image"].startswith("vllm/vllm-openai:")
    assert container["command"] == ["vllm", "serve"]
    args = container["args"]
    assert args[:4] == ["--model", f"/data/models/{NAME}/production", "--served-model-name", NAME]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    # The gateway sends tenants' classes as `priority`: vLLM refuses any but 0 without this.
    assert args[args.index("--scheduling-policy") + 1] == "priority"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "securityContext" not in container  # the vLLM image runs as root
    if serving == "deployment":
        hpa = one(objects, "HorizontalPodAutoscaler")
        names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
        assert names == ["vllm:num_requests_running", "vllm:num_requests_waiting"]
        gateway = next(o for o in objects if o["metadata"].get("name", "").endswith("-gateway")
                       and o["kind"] == "Deployment")  # fmt: skip
        env = {e["name"]: e.get("value") for e in gateway["spec"]["template"]["spec"]
               ["containers"][0]["env"]}  # fmt: skip
        assert env["MODELSHIP_GATEWAY_ENGINE"] == "vllm"  # its health path, priority order


def test_our_engine_runs_modelship_serve_with_engine_flags() -> None:
    config = config_for("deployment")
    objects = render(config).objects
    _, container = engine_pod(objects, "deployment")

    assert container["command"] == ["modelship"]
    assert container["args"][:9] == [
        "serve", f"/data/models/{NAME}/production", "--host", "0.0.0.0", "--port", "8000",
        "--served-model-name", NAME, *config.serve.engine.cli_args()[:1],
    ]  # fmt: skip
    assert container["args"][-4:] == ["--grace-period", "30", "--stall-timeout", "120"]
    flags = container["args"]
    assert flags[flags.index("--max-n") + 1] == "16"  # the gateway's caps, as `up` gives them
    assert flags[flags.index("--log-format") + 1] == "text"
    assert "--trace-exporter" not in flags  # tracing off by default
    mount = container["volumeMounts"][0]
    assert mount == {"name": "data", "mountPath": "/data", "readOnly": True}


def test_deployment_engine_probes_drain_and_grace() -> None:
    config = config_for("deployment", serve={"grace_period_s": 120})
    objects = render(config).objects
    pod, container = engine_pod(objects, "deployment")

    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    # preStop sleep + the server's own drain must fit in the grace period.
    assert pod["terminationGracePeriodSeconds"] > 5 + 120
    service = one(objects, "Service", f"{NAME}-engine")
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    assert ports["metrics"]["targetPort"] == "http"  # /metrics is on the serve port


def test_hpa_scales_on_concurrency_with_stabilization_windows() -> None:
    config = config_for(
        "deployment",
        deploy={
            "serving": {
                "min_replicas": 2,
                "max_replicas": 9,
                "target_concurrency": 16,
                "scale_up_stabilization_s": 30,
                "scale_down_stabilization_s": 600,
            }
        },
    )
    spec = one(render(config).objects, "HorizontalPodAutoscaler")["spec"]
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 9)
    running = spec["metrics"][0]["pods"]
    assert running["metric"]["name"] == "modelship:num_requests_running"
    assert running["target"] == {"type": "AverageValue", "averageValue": "16"}
    assert spec["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 30
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600
    assert spec["scaleTargetRef"]["name"] == f"{NAME}-engine"


def test_keda_queries_prometheus_per_replica() -> None:
    spec = one(render(config_for("deployment", "keda")).objects, "ScaledObject")["spec"]
    trigger = spec["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert "modelship:num_requests_running" in trigger["metadata"]["query"]
    assert trigger["metadata"]["threshold"] == "8"
    assert spec["minReplicaCount"] == 1
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]


def test_kserve_is_knative_concurrency_scaled_with_canary() -> None:
    objects = render(config_for("kserve", canary=True)).objects
    isvc = one(objects, "InferenceService")
    predictor = isvc["spec"]["predictor"]

    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Knative"
    assert predictor["scaleMetric"] == "concurrency" and predictor["scaleTarget"] == 8
    assert predictor["minReplicas"] >= 1 and predictor["maxReplicas"] == 4
    assert predictor["canaryTrafficPercent"] == 10
    container = predictor["containers"][0]
    assert container["name"] == "kserve-container"
    assert f"/data/models/{NAME}/releases/2" in container["args"]
    # Knative rejects lifecycle hooks and grace periods; its timeout bounds the drain.
    assert "lifecycle" not in container and "terminationGracePeriodSeconds" not in predictor
    assert predictor["timeout"] >= 30 + 5
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_kserve_without_canary_has_no_traffic_split() -> None:
    predictor = one(render(config_for("kserve")).objects, "InferenceService")["spec"]["predictor"]
    assert "canaryTrafficPercent" not in predictor


def test_deployment_canary_is_a_pinned_track_the_gateway_splits() -> None:
    objects = render(config_for("deployment", canary=True)).objects
    canary = one(objects, "Deployment", f"{NAME}-engine-canary")
    container = canary["spec"]["template"]["spec"]["containers"][0]

    assert canary["spec"]["replicas"] == 1
    assert container["args"][1] == f"/data/models/{NAME}/releases/2"
    one(objects, "Service", f"{NAME}-engine-canary")
    gateway = one(objects, "Deployment", f"{NAME}-gateway")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in gateway["containers"][0]["env"]}
    # The weight is the release plan's (`modelship release canary`), which the gateway follows.
    assert "MODELSHIP_GATEWAY_CANARY_WEIGHT" not in env
    assert (env["MODELSHIP_STORAGE"], env["MODELSHIP_GATEWAY_MODEL"]) == ("/data", NAME)
    services = env["MODELSHIP_GATEWAY_DISCOVER_SERVICES"].split(",")
    assert services == [f"{NAME}-engine", f"{NAME}-engine-canary"]
    labels = one(objects, "Service", f"{NAME}-engine-canary")["metadata"]["labels"]
    assert labels["modelship.io/track"] == "canary"  # copied onto its EndpointSlices
    # The stable engine has no replica count: the autoscaler owns it.
    assert "replicas" not in one(objects, "Deployment", f"{NAME}-engine")["spec"]


def test_gateway_runs_modelship_gateway_with_the_config() -> None:
    objects = render(config_for("deployment")).objects
    gateway = one(objects, "Deployment", f"{NAME}-gateway")
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == [
        "gateway", "--config", "/etc/modelship/pipeline.yaml", "--host", "0.0.0.0",
        "--port", "8080",
    ]  # fmt: skip
    assert gateway["spec"]["replicas"] == 2
    one(objects, "Service", f"{NAME}-gateway")
    one(objects, "PodDisruptionBudget", f"{NAME}-gateway")


def test_the_gateway_discovers_the_engine_pods_with_a_role_that_reads_endpointslices() -> None:
    """The engine Service is headless (its EndpointSlices list the pods, each an upstream of
    the gateway) and the gateway's ServiceAccount may list and watch them, and Leases."""
    objects = render(config_for("deployment")).objects
    engine = one(objects, "Service", f"{NAME}-engine")
    assert engine["spec"]["clusterIP"] == "None"
    assert engine["metadata"]["labels"]["modelship.io/track"] == "stable"
    pod = one(objects, "Deployment", f"{NAME}-gateway")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["MODELSHIP_GATEWAY_DISCOVER_SERVICES"] == f"{NAME}-engine"
    assert "MODELSHIP_GATEWAY_ENDPOINTS" not in env
    account = one(objects, "ServiceAccount", pod["serviceAccountName"])
    binding = one(objects, "RoleBinding", account["metadata"]["name"])
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]
    role = one(objects, "Role", binding["roleRef"]["name"])
    verbs = {(r["apiGroups"][0], r["resources"][0]): set(r["verbs"]) for r in role["rules"]}
    assert verbs[("discovery.k8s.io", "endpointslices")] == {"get", "list", "watch"}
    assert {"get", "create", "update"} <= verbs[("coordination.k8s.io", "leases")]


def test_every_gateway_replica_writes_the_usage_ledger_to_the_models_volume() -> None:
    """Each gateway pod appends its own ledger file to the model's usage/ folder on the
    models volume, which `modelship usage` reads (`gateway/cost.py`)."""
    from modelship.gateway.cost import USAGE_DIR

    pod = one(render(config_for("deployment")).objects, "Deployment", f"{NAME}-gateway")
    spec = pod["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["MODELSHIP_GATEWAY_USAGE_DIR"] == f"/data/models/{NAME}/{USAGE_DIR}"
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/data")
    assert not mount.get("readOnly")
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert not volume["persistentVolumeClaim"].get("readOnly")


def test_pinned_release_renders_a_rollback() -> None:
    config = config_for("deployment", deploy={"serving": {"release": 1}})
    _, container = engine_pod(render(config).objects, "deployment")
    assert container["args"][1] == f"/data/models/{NAME}/releases/1"


def test_workflow_dag_runs_optimize_in_parallel() -> None:
    workflow = one(render(config_for()).objects, "Workflow")
    templates = {t["name"]: t for t in workflow["spec"]["templates"]}
    tasks = {t["name"]: t for t in templates[workflow["spec"]["entrypoint"]]["dag"]["tasks"]}

    assert "dependencies" not in tasks["acquire"]
    variants = ["fp16", "awq", "gptq"]
    for variant in variants:
        task = tasks[f"optimize-{variant}"]
        assert task["dependencies"] == ["acquire"]
        assert task["arguments"]["parameters"] == [{"name": "variant", "value": variant}]
    assert tasks["select"]["dependencies"] == [f"optimize-{v}" for v in variants]
    assert tasks["deploy"]["dependencies"] == ["select"]
    assert workflow["spec"]["parallelism"] == 3
    optimize = templates["optimize"]["container"]["args"]
    assert optimize == [
        "optimize", "--config", "/etc/modelship/pipeline.yaml", "--storage", "/data",
        "--variant", "{{inputs.parameters.variant}}",
    ]  # fmt: skip
    assert templates["select"]["container"]["args"][0] == "select"


def test_workflow_memoizes_acquire_on_model_and_revision() -> None:
    config = ModelshipConfig.from_dict({"source": "HuggingFaceTB/SmolLM2-135M", "revision": "v1"})
    workflow = one(render(config).objects, "Workflow")
    templates = {t["name"]: t for t in workflow["spec"]["templates"]}

    memo = templates["acquire"]["memoize"]
    assert memo["key"] == "acquire.huggingfacetb--smollm2-135m.v1"
    assert memo["cache"]["configMap"]["name"] == "huggingfacetb-smollm2-135m-acquire-cache"
    run = templates["acquire-run"]["container"]["args"]
    assert run == [
        "acquire", "HuggingFaceTB/SmolLM2-135M", "--revision", "v1",
        "--name", "huggingfacetb--smollm2-135m", "--storage", "/data",
    ]  # fmt: skip
    cache = one(render(config).objects, "ConfigMap", memo["cache"]["configMap"]["name"])
    assert cache["metadata"]["labels"]["workflows.argoproj.io/configmap-type"] == "Cache"


def test_workflow_retries_only_transient_failures() -> None:
    config = config_for(retries={"max_attempts": 4, "backoff_s": 1.5, "max_backoff_s": 60})
    workflow = one(render(config).objects, "Workflow")
    for template in workflow["spec"]["templates"]:
        if "container" not in template and "resource" not in template:
            continue
        strategy = template["retryStrategy"]
        assert strategy["limit"] == 3
        assert strategy["backoff"] == {"duration": "1500ms", "factor": 2, "cap": "60s"}
        assert "lastRetry.status == 'Error'" in strategy["expression"]
        assert "asInt(lastRetry.exitCode) == 75" in strategy["expression"]


def test_workflow_optimize_gets_gpus_when_configured() -> None:
    workflow = one(render(config_for(gpu="gpu")).objects, "Workflow")
    templates = {t["name"]: t for t in workflow["spec"]["templates"]}
    assert templates["optimize"]["container"]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert templates["optimize"]["tolerations"]
    assert "nvidia.com/gpu" not in json.dumps(templates["acquire-run"])


@pytest.mark.parametrize("serving", ["kserve", "deployment"])
def test_deploy_step_applies_the_serving_objects(serving: str) -> None:
    rendered = render(config_for(serving))
    workflow = one(rendered.objects, "Workflow")
    templates = {t["name"]: t for t in workflow["spec"]["templates"]}
    steps = templates["deploy"]["steps"][0]
    applied = [json.loads(step["arguments"]["parameters"][0]["value"]) for step in steps]

    assert templates["apply"]["resource"]["action"] == "apply"
    serving_objects = rendered.files["serving.yaml"]
    assert len(applied) == len(serving_objects)
    for original, copy_ in zip(serving_objects, applied, strict=True):
        stamped = json.dumps(copy_)
        if (
            original["kind"] in ("Deployment", "InferenceService")
            and "gateway" not in (original["metadata"]["name"])
        ):
            assert ROLLOUT_ANNOTATION in stamped and "{{workflow.name}}" in stamped
        else:
            assert copy_ == original


def test_canary_track_is_not_restarted_by_the_workflow() -> None:
    rendered = render(config_for("deployment", canary=True))
    workflow = one(rendered.objects, "Workflow")
    deploy = next(t for t in workflow["spec"]["templates"] if t["name"] == "deploy")
    for step in deploy["steps"][0]:
        manifest = json.loads(step["arguments"]["parameters"][0]["value"])
        if manifest["metadata"]["name"].endswith("-canary") and manifest["kind"] == "Deployment":
            annotations = manifest["spec"]["template"]["metadata"]["annotations"]
            assert ROLLOUT_ANNOTATION not in annotations


def test_config_map_holds_a_loadable_pipeline_yaml_without_the_key() -> None:
    config = config_for(serve={"api_key": "sk-secret", "port": 8001})
    objects = render(config).objects
    config_map = one(objects, "ConfigMap", f"{NAME}-config")
    loaded = ModelshipConfig.from_dict(yaml.safe_load(config_map["data"]["pipeline.yaml"]))

    assert str(loaded.storage) == "/data"
    assert loaded.name == NAME  # the stages act on this model, never a guess from the PVC
    assert loaded.serve.port == 8001 and loaded.serve.api_key is None
    secret = one(objects, "Secret")
    assert secret["stringData"] == {"api-key": "sk-secret"}
    _, container = engine_pod(objects, "deployment")
    ref = container["env"][0]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-key"}


def test_existing_secret_is_referenced_not_rendered() -> None:
    config = config_for(serve={"api_key": "sk"}, deploy={"serving": {"api_key_secret": "my-key"}})
    objects = render(config).objects
    assert by_kind(objects, "Secret") == []
    _, container = engine_pod(objects, "deployment")
    assert container["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "my-key"


def test_pvc_is_rendered_from_storage_settings(schema_dir: Path) -> None:
    config = config_for(
        deploy={
            "storage": {"pvc_name": "models", "size": "2Ti", "storage_class": "fast-rwx"},
            "namespace": "llm",
        }
    )
    objects = render(config).objects
    pvc = one(objects, "PersistentVolumeClaim", "models")
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "2Ti"}},
        "storageClassName": "fast-rwx",
    }
    namespaced = [obj for obj in objects if obj["kind"] != "Namespace"]
    assert {obj["metadata"]["namespace"] for obj in namespaced} == {"llm"}
    assert validate_objects(objects, schema_dir) == []


def test_cluster_yaml_creates_the_namespace_first() -> None:
    rendered = render(config_for(deploy={"namespace": "llm"}))
    first = rendered.files["cluster.yaml"][0]
    assert first["kind"] == "Namespace" and first["metadata"]["name"] == "llm"
    assert "namespace" not in first["metadata"]  # cluster-scoped
    assert by_kind(rendered.objects, "Namespace") == [first]


def test_a_namespace_managed_elsewhere_is_not_rendered() -> None:
    objects = render(config_for(deploy={"create_namespace": False})).objects
    assert by_kind(objects, "Namespace") == []


@pytest.mark.parametrize("serving", ["kserve", "deployment"])
def test_rendered_files_have_no_yaml_anchors(serving: str, tmp_path: Path) -> None:
    # The Role's rules share one verbs list: PyYAML's default writes `&id001` / `*id001`.
    write_rendered(render(config_for(serving)), tmp_path / "k8s")
    for path in sorted((tmp_path / "k8s").glob("*.yaml")):
        text = path.read_text()
        assert not re.search(r"[&*]id\d{3}", text), path.name
        for doc in yaml.safe_load_all(text):
            if doc and doc.get("kind") == "ConfigMap" and "pipeline.yaml" in doc.get("data", {}):
                assert not re.search(r"[&*]id\d{3}", doc["data"]["pipeline.yaml"])


def test_schema_validation_catches_a_misspelt_field(schema_dir: Path) -> None:
    """The validators are not vacuous: an unknown field fails, core and custom kinds alike."""
    kserve = render(config_for("kserve")).files["serving.yaml"]
    broken = copy.deepcopy(render(config_for("deployment", "keda")).objects + kserve)
    one(broken, "Workflow")["spec"]["templates"][1]["retryStrategy"] = {"limits": 3}
    one(broken, "InferenceService")["spec"]["predictor"]["scaleMetrc"] = "concurrency"
    one(broken, "ScaledObject")["spec"]["maxReplicas"] = 3
    deployment = one(broken, "Deployment", f"{NAME}-engine")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}

    problems = validate_objects(broken, schema_dir)
    failing = {problem.split(":")[0] for problem in problems}
    assert len(failing) == 4, problems  # the InferenceService fails as itself and as Knative
    assert any("limits" in p for p in problems) and any("scaleMetrc" in p for p in problems)
    assert any("maxReplicas" in p for p in problems)
    assert any("readinesProbe" in p for p in problems)


def test_knative_view_rejects_pod_fields_knative_forbids(schema_dir: Path) -> None:
    objects = render(config_for("kserve")).objects
    isvc = one(objects, "InferenceService")
    isvc["spec"]["predictor"]["containers"][0]["lifecycle"] = {
        "preStop": {"exec": {"command": ["sleep", "5"]}}
    }
    problems = validate_objects([isvc], schema_dir)
    assert problems and all("as Knative Service" in p for p in problems)


def test_workflow_without_deploy_step_for_helm_or_gitops(schema_dir: Path) -> None:
    rendered = render(config_for(deploy={"workflow": {"deploy_step": False}}))
    workflow = one(rendered.objects, "Workflow")
    names = {t["name"] for t in workflow["spec"]["templates"]}
    assert names == {"pipeline", "acquire", "acquire-run", "optimize", "select"}
    tasks = workflow["spec"]["templates"][0]["dag"]["tasks"]
    assert tasks[-1]["name"] == "select"
    role = one(rendered.objects, "Role", f"{NAME}-pipeline")
    assert [rule["resources"] for rule in role["rules"]] == [["workflowtaskresults"]]
    assert validate_objects(rendered.objects, schema_dir) == []


def test_a_draft_model_renders_for_both_engines() -> None:
    for gpu in ("vllm", "cpu"):
        config = config_for("deployment", gpu=gpu)
        engine = config.serve.engine.model_copy(
            update={"num_speculative_tokens": 4, "speculative_model": "/data/models/draft"}
        )
        serve = config.serve.model_copy(update={"engine": engine})
        _, container = engine_pod(render(config.model_copy(update={"serve": serve})).objects,
                                  "deployment")  # fmt: skip
        args = container["args"]
        if gpu == "vllm":
            spec = json.loads(args[args.index("--speculative-config") + 1])
            assert spec == {"model": "/data/models/draft", "num_speculative_tokens": 4}
        else:
            assert args[args.index("--speculative-model") + 1] == "/data/models/draft"


def test_replicas_get_the_log_format_tracing_and_request_caps() -> None:
    config = config_for(
        "deployment",
        log_format="json",
        tracing={"exporter": "otlp", "endpoint": "http://otel-collector:4318", "sample_ratio": 0.1},
        gateway={"request_limits": {"max_n": 4}},
    )
    _, container = engine_pod(render(config).objects, "deployment")
    flags = container["args"]
    pairs = dict(itertools.pairwise(flags))
    assert pairs["--log-format"] == "json" and pairs["--max-n"] == "4"
    assert pairs["--trace-exporter"] == "otlp"
    assert pairs["--trace-endpoint"] == "http://otel-collector:4318"
    assert pairs["--trace-sample-ratio"] == "0.1"


@pytest.mark.parametrize("gpu", ["cpu", "vllm"])
def test_lora_adapters_render_for_both_engines(gpu: str) -> None:
    loras = {"sql": "/data/adapters/sql", "chat": "/data/adapters/chat"}
    config = config_for("deployment", gpu=gpu, serve={"loras": loras, "max_loras": 2})
    _, container = engine_pod(render(config).objects, "deployment")
    flags = container["args"]
    if gpu == "cpu":  # ours: the same flags `modelship up` gives its replicas
        assert "--lora" in flags and "sql=/data/adapters/sql" in flags
        assert flags[flags.index("chat=/data/adapters/chat") - 1] == "--lora"
    else:
        assert "--enable-lora" in flags
        modules = flags.index("--lora-modules")
        assert flags[modules + 1 : modules + 3] == [
            "sql=/data/adapters/sql",
            "chat=/data/adapters/chat",
        ]
    assert flags[flags.index("--max-loras") + 1] == "2"


@pytest.mark.parametrize("autoscaler", ["hpa", "keda"])
def test_a_tier_is_an_engine_deployment_of_its_variant(autoscaler: str, schema_dir: Path) -> None:
    gateway = {"tiers": [{"name": "economy", "variant": "gptq", "min_replicas": 1,
                          "max_replicas": 3}]}  # fmt: skip
    objects = render(config_for("deployment", autoscaler, gateway=gateway)).objects
    assert validate_objects(objects, schema_dir) == []
    assert check_objects(objects) == []
    name = f"{NAME}-engine-tier-economy"
    tier = one(objects, "Deployment", name)
    container = tier["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][1] == f"/data/models/{NAME}/optimized/gptq"
    assert container["args"][container["args"].index("--variant") + 1] == "gptq"
    assert "replicas" not in tier["spec"]  # its autoscaler owns it
    one(objects, "Service", name)
    one(objects, "PodDisruptionBudget", name)  # a node drain keeps the tier's minimum
    if autoscaler == "keda":
        scaled = one(objects, "ScaledObject", name)["spec"]
        assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (1, 3)
        assert f'pod=~"{name}-' in scaled["triggers"][0]["metadata"]["query"]
    else:
        hpa = one(objects, "HorizontalPodAutoscaler", name)["spec"]
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 3)
        assert hpa["scaleTargetRef"]["name"] == name
    gateway_pod = one(objects, "Deployment", f"{NAME}-gateway")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in gateway_pod["containers"][0]["env"]}
    assert env["MODELSHIP_GATEWAY_DISCOVER_SERVICES"] == f"{NAME}-engine,{name}"
    labels = one(objects, "Service", name)["metadata"]["labels"]
    assert (labels["modelship.io/tier"], labels["modelship.io/variant"]) == ("economy", "gptq")


def test_tiers_are_not_rendered_for_kserve() -> None:
    from modelship.deploy.render import RenderError

    gateway = {"tiers": [{"name": "economy", "variant": "gptq"}]}
    with pytest.raises(RenderError, match=r"gateway\.tiers: rendered for deploy\.serving\.kind"):
        render(config_for("kserve", gateway=gateway))


def test_the_kv_cache_dtype_reaches_vllm_or_is_refused() -> None:
    from modelship.deploy.render import RenderError

    def vllm_args(kv_cache_dtype: str) -> list[str]:
        config = config_for("deployment", gpu="vllm")
        engine = config.serve.engine.model_copy(update={"kv_cache_dtype": kv_cache_dtype})
        config = config.model_copy(
            update={"serve": config.serve.model_copy(update={"engine": engine})}
        )
        return engine_pod(render(config).objects, "deployment")[1]["args"]

    args = vllm_args("fp8")
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--kv-cache-dtype" not in vllm_args("bfloat16")  # the model's dtype: vLLM's auto
    with pytest.raises(RenderError, match="vLLM has no int8 KV cache"):
        vllm_args("int8")


def test_tenants_need_a_key_the_engines_trust() -> None:
    from modelship.deploy.render import RenderError
    from modelship.gateway import hash_api_key

    gateway = {"tenants": [{"name": "a", "api_key_sha256": hash_api_key("sk-a")}]}
    # Without one, the engines would ignore every tenant's cache namespace: one shared cache.
    with pytest.raises(RenderError, match=r"gateway\.tenants: .* set serve\.api_key"):
        render(config_for("deployment", gateway=gateway))
    keyed = render(config_for("deployment", gateway=gateway, serve={"api_key": "sk-replicas"}))
    assert by_kind(keyed.objects, "Secret")


def test_tenant_quotas_across_gateway_replicas_need_a_shared_store() -> None:
    from modelship.deploy.render import RenderError
    from modelship.gateway import hash_api_key

    tenants = [
        {"name": "free", "api_key_sha256": hash_api_key("sk-free")},
        {"name": "paid", "api_key_sha256": hash_api_key("sk-paid"), "requests_per_minute": 60},
    ]
    serve = {"api_key": "sk-replicas"}
    # Two gateway replicas (the default), each keeping its own buckets: 2x every quota.
    with pytest.raises(RenderError) as refused:
        render(config_for("deployment", gateway={"tenants": tenants}, serve=serve))
    message = str(refused.value)
    assert "gateway.state" in message and "deploy.serving.gateway.replicas is 2" in message
    assert "'paid'" in message and "'free'" not in message  # only tenants with quotas
    shared = {"tenants": tenants, "state": "redis://quota-store:6379/0"}
    assert render(config_for("deployment", gateway=shared, serve=serve)).objects
    one = config_for("deployment", gateway={"tenants": tenants}, serve=serve)
    serving = one.deploy.serving
    gateway = serving.gateway.model_copy(update={"replicas": 1})
    deploy = one.deploy.model_copy(
        update={"serving": serving.model_copy(update={"gateway": gateway})}
    )
    assert render(one.model_copy(update={"deploy": deploy})).objects
