"""Kubernetes actuator: one Deployment per model pool, built from deploy/base/pool/deployment.yaml (the same
template the kustomize overlays deploy), scaled through the `scale` subresource.

- `scale` PATCHes `/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`; when the pool's Deployment does not
  exist yet (404) it creates it with that many replicas (`ensure_workload`).
- `counts` reads the scale and the pool's pods, and registers the pods with the registry so routers can route
  to them: replica id = pod name, gRPC at the pod IP, state `serving` once the pod is Ready (Triton's readiness),
  `starting` before, `draining` once Kubernetes is deleting it (its preStop drain runs); rows of vanished pods
  are deleted.
- cold starts are measured from pod status: the Ready condition's lastTransitionTime minus the pod's creation
  (scheduling, image pull, weight staging, engine load), once per pod; `cold_start_s` is their p90.
Pods deleted on scale-down run the preStop drain (routers stop admitting, the backend's active requests finish)
within the grace period.
"""
from __future__ import annotations

import copy
import logging
import math
from datetime import datetime
from typing import Any

import yaml

from autoscale.actuators import PoolSpec, ReplicaCounts
from common.settings import REPO_ROOT

log = logging.getLogger(__name__)

POOL_TEMPLATE = REPO_ROOT / "deploy" / "base" / "pool" / "deployment.yaml"
POOL_LABEL = "fleet.ai/pool"
TP_GROUP_LABEL = "fleet.ai/tp-group"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
REGION_LABEL = "topology.kubernetes.io/region"
DEFAULT_IMAGE = "registry.example.com/llm-fleet-gpu:0.1.0-trtllm0.17"  # `fleet autoscale run --image` overrides
GRPC_PORT, HTTP_PORT, METRICS_PORT = 8001, 8000, 8002


def deployment_name(pool: PoolSpec) -> str:
    return f"llm-{pool.name}"[:63].rstrip("-")


def deployment_manifest(pool: PoolSpec, namespace: str, image: str = DEFAULT_IMAGE,
                        replicas: int | None = None) -> dict[str, Any]:
    """The pool's Deployment (apps/v1) as a plain dict: the pool template with this pool's model, version,
    tensor parallelism (GPUs + MPI ranks), image, labels and GPU node placement."""
    manifest = copy.deepcopy(yaml.safe_load(POOL_TEMPLATE.read_text()))  # deep copy: the template shares its env
    labels = {"app.kubernetes.io/name": "llm-replica", POOL_LABEL: pool.name, "fleet.ai/model": pool.model,
              "fleet.ai/version": pool.version, "fleet.ai/region": pool.region}
    manifest["metadata"] = {"name": deployment_name(pool), "namespace": namespace, "labels": labels}
    spec = manifest["spec"]
    spec["selector"] = {"matchLabels": {"app.kubernetes.io/name": "llm-replica", POOL_LABEL: pool.name}}
    spec["template"]["metadata"]["labels"] = labels
    if replicas is None:
        spec.pop("replicas", None)  # a patch must not reset the count the autoscaler set
    else:
        spec["replicas"] = replicas
    pod = spec["template"]["spec"]
    tp = str(pool.tensor_parallel)
    for container in pod["initContainers"] + pod["containers"]:
        container["image"] = image
        env = [e for e in container.get("env", []) if e["name"] not in ("FLEET_MODEL", "FLEET_VERSION",
                                                                            "FLEET_TENSOR_PARALLEL", "FLEET_REGION")]
        if container["name"] != "state":
            env = [{"name": "FLEET_MODEL", "value": pool.model}, {"name": "FLEET_VERSION", "value": pool.version},
                   {"name": "FLEET_TENSOR_PARALLEL", "value": tp}] + env
        container["env"] = env + [{"name": "FLEET_REGION", "value": pool.region}]
        if container["name"] == "triton":
            for kind in ("requests", "limits"):
                container["resources"][kind]["nvidia.com/gpu"] = tp
    pod["nodeSelector"] = {GPU_COUNT_LABEL: "8", TP_GROUP_LABEL: f"tp{tp}", REGION_LABEL: pool.region}
    pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return manifest


def _ready_at(pod: Any) -> datetime | None:
    for cond in (pod.status.conditions or []) if pod.status else []:
        if cond.type == "Ready" and cond.status == "True":
            return cond.last_transition_time
    return None


class KubernetesActuator:
    """Scales one Deployment per pool. `api_client` lets tests point it at a recorded API server."""

    def __init__(self, namespace: str = "llm", api_client: Any | None = None, image: str | None = None,
                 db_url: str | None = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace, self.image, self.db_url = namespace, image or DEFAULT_IMAGE, db_url
        self._cold_starts: dict[str, list[float]] = {}
        self._measured: set[str] = set()

    def ensure_workload(self, pool: PoolSpec, replicas: int | None = None) -> str:
        """Create the pool's Deployment, or patch it to the current manifest (replicas untouched unless given)."""
        from kubernetes.client.exceptions import ApiException

        name = deployment_name(pool)
        manifest = deployment_manifest(pool, self.namespace, self.image, replicas)
        try:
            self.apps.read_namespaced_deployment(name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.apps.create_namespaced_deployment(self.namespace, manifest, _headers={"Content-Type": "application/json"})
            log.info("created deployment %s/%s (%s replicas)", self.namespace, name, replicas)
            return name
        self.apps.patch_namespaced_deployment(name, self.namespace, manifest)
        log.info("patched deployment %s/%s", self.namespace, name)
        return name

    def counts(self, pool: PoolSpec) -> ReplicaCounts:
        """Replica counts from the Deployment's scale and status; registers the pool's pods on the way."""
        from kubernetes.client.exceptions import ApiException

        name = deployment_name(pool)
        try:
            scale = self.apps.read_namespaced_deployment_scale(name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return ReplicaCounts()  # not created yet: the first scale() creates it
        desired = scale.spec.replicas or 0
        status = self.apps.read_namespaced_deployment_status(name, self.namespace).status
        ready = status.ready_replicas or 0
        self.sync_replicas(pool)
        return ReplicaCounts(serving=min(ready, desired), starting=max(desired - ready, 0),
                             draining=max((status.replicas or 0) - desired, 0))

    def scale(self, pool: PoolSpec, desired: int) -> None:
        from kubernetes.client.exceptions import ApiException

        name = deployment_name(pool)
        try:
            self.apps.patch_namespaced_deployment_scale(name, self.namespace, {"spec": {"replicas": int(desired)}})
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.ensure_workload(pool, replicas=int(desired))
            return
        log.info("scaled deployment %s/%s to %d replicas", self.namespace, name, desired)

    def pool_pods(self, pool: PoolSpec) -> list[Any]:
        return self.core.list_namespaced_pod(self.namespace, label_selector=f"{POOL_LABEL}={pool.name}").items

    def sync_replicas(self, pool: PoolSpec) -> dict[str, str]:
        """Register the pool's pods (pod IPs) for the routers; record cold starts. Returns pod name -> state."""
        from registry import queries
        from registry.db import session_scope

        states: dict[str, dict[str, Any]] = {}
        for pod in self.pool_pods(pool):
            ready_at, ip = _ready_at(pod), pod.status.pod_ip if pod.status else None
            if pod.metadata.deletion_timestamp is not None:
                state = "draining"
            elif ready_at is not None and ip:
                state = "serving"
            else:
                state = "starting"
            if ready_at is not None and pod.metadata.name not in self._measured:
                self._measured.add(pod.metadata.name)
                seconds = (ready_at - pod.metadata.creation_timestamp).total_seconds()
                self._cold_starts.setdefault(pool.model, []).append(seconds)
                log.info("pod %s ready %.0f s after creation (cold start)", pod.metadata.name, seconds)
            states[pod.metadata.name] = {
                "state": state, "model": pool.model, "version": pool.version, "region": pool.region, "pid": 0,
                "grpc_url": f"{ip}:{GRPC_PORT}" if ip else "", "http_url": f"http://{ip}:{HTTP_PORT}" if ip else "",
                "metrics_url": f"http://{ip}:{METRICS_PORT}/metrics" if ip else ""}
        if self.db_url is None:
            from common.settings import load_settings
            self.db_url = load_settings().db_url
        with session_scope(self.db_url) as s:
            for row in queries.list_replicas(s, pool.model):
                if row.version == pool.version and row.replica_id not in states:
                    queries.delete_replica(s, row.replica_id)
            for replica_id, fields in states.items():
                queries.upsert_replica(s, replica_id, **fields)
        return {k: v["state"] for k, v in states.items()}

    def cold_start_s(self, pool: PoolSpec) -> float | None:
        starts = sorted(self._cold_starts.get(pool.model, []))
        return starts[min(len(starts) - 1, math.ceil(0.9 * len(starts)) - 1)] if starts else None
