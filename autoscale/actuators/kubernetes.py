"""Kubernetes actuator: one Deployment per model pool, scaled through the `scale` subresource.

Uses the official `kubernetes` Python client (AppsV1Api). `ensure_workload` creates or patches the
pool's Deployment: Triton (TensorRT-LLM) container with `nvidia.com/gpu: <tp>` limits, node
selectors that pin a tensor-parallel group to one node shape (`nvidia.com/gpu.count: "8"`,
`fleet.ai/tp-group: tp<N>`, `topology.kubernetes.io/region`), a preStop hook that drains the
replica (the router stops admitting, streams finish) and a grace period long enough for it.
`scale` then PATCHes `/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale` with spec.replicas.
Pods being deleted on scale-down run the preStop drain, so streams finish before the container stops.
"""
from __future__ import annotations

import logging
from typing import Any

from autoscale.actuators import PoolSpec, ReplicaCounts

log = logging.getLogger(__name__)

TP_GROUP_LABEL = "fleet.ai/tp-group"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
REGION_LABEL = "topology.kubernetes.io/region"
DEFAULT_IMAGE = "nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3"
# Drain before SIGTERM: ask the router(s) to stop admitting to this replica, then wait until Triton
# holds no pending request (streams finished); the grace period bounds the wait.
PRESTOP_DRAIN = ('for r in $(echo "$FLEET_ROUTER_URLS" | tr , " "); do '
                 'curl -fsS -X POST "$r/admin/replicas/$FLEET_REPLICA_ID/drain" || true; done; sleep 2; '
                 'while curl -fsS localhost:8002/metrics | grep -Eq "^nv_inference_pending_request_count.* [1-9]"; '
                 'do sleep 1; done')


def deployment_name(pool: PoolSpec) -> str:
    return f"llm-{pool.name}"[:63].rstrip("-")


def deployment_manifest(pool: PoolSpec, namespace: str, image: str = DEFAULT_IMAGE, replicas: int | None = None,
                        router_urls: str = "http://llm-router:8030", drain_grace_s: int = 120) -> dict[str, Any]:
    """The Deployment for one pool (apps/v1), as a plain dict the client serialises unchanged."""
    labels = {"app.kubernetes.io/name": "llm-replica", "fleet.ai/model": pool.model, "fleet.ai/version": pool.version,
              "fleet.ai/region": pool.region}
    env = [{"name": "FLEET_MODEL", "value": pool.model}, {"name": "FLEET_VERSION", "value": pool.version},
           {"name": "FLEET_REGION", "value": pool.region}, {"name": "FLEET_ROUTER_URLS", "value": router_urls},
           {"name": "FLEET_REPLICA_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    container = {
        "name": "triton", "image": image,
        "args": ["tritonserver", f"--model-repository=/models/{pool.model}/{pool.version}/model_repository",
                 "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", "--exit-timeout-secs=60"],
        "env": env,
        "ports": [{"name": "http", "containerPort": 8000}, {"name": "grpc", "containerPort": 8001},
                  {"name": "metrics", "containerPort": 8002}],
        "resources": {"limits": {"nvidia.com/gpu": str(pool.tensor_parallel)},
                      "requests": {"nvidia.com/gpu": str(pool.tensor_parallel)}},
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": 8000}, "periodSeconds": 5},
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", PRESTOP_DRAIN]}}},
    }
    spec: dict[str, Any] = {
        "selector": {"matchLabels": labels},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "nodeSelector": {GPU_COUNT_LABEL: "8", TP_GROUP_LABEL: f"tp{pool.tensor_parallel}", REGION_LABEL: pool.region},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "terminationGracePeriodSeconds": drain_grace_s,
                "containers": [container],
            },
        },
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": deployment_name(pool), "namespace": namespace, "labels": labels}, "spec": spec}


class KubernetesActuator:
    """Scales one Deployment per pool. `api_client` lets tests point it at a recorded API server."""

    def __init__(self, namespace: str = "llm", api_client: Any | None = None, image: str = DEFAULT_IMAGE,
                 router_urls: str = "http://llm-router:8030") -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace, self.image, self.router_urls = namespace, image, router_urls
        self._cold_starts: dict[str, list[float]] = {}

    def ensure_workload(self, pool: PoolSpec, replicas: int | None = None) -> str:
        """Create the pool's Deployment, or patch it to the current manifest (replicas untouched unless given)."""
        from kubernetes.client.exceptions import ApiException

        name = deployment_name(pool)
        manifest = deployment_manifest(pool, self.namespace, self.image, replicas, self.router_urls)
        try:
            self.apps.read_namespaced_deployment(name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.apps.create_namespaced_deployment(self.namespace, manifest, _headers={"Content-Type": "application/json"})
            log.info("created deployment %s/%s", self.namespace, name)
            return name
        self.apps.patch_namespaced_deployment(name, self.namespace, manifest)
        log.info("patched deployment %s/%s", self.namespace, name)
        return name

    def counts(self, pool: PoolSpec) -> ReplicaCounts:
        scale = self.apps.read_namespaced_deployment_scale(deployment_name(pool), self.namespace)
        desired = scale.spec.replicas or 0
        status = self.apps.read_namespaced_deployment_status(deployment_name(pool), self.namespace).status
        ready = status.ready_replicas or 0
        return ReplicaCounts(serving=min(ready, desired), starting=max(desired - ready, 0),
                             draining=max((status.replicas or 0) - desired, 0))

    def scale(self, pool: PoolSpec, desired: int) -> None:
        name = deployment_name(pool)
        self.apps.patch_namespaced_deployment_scale(name, self.namespace, {"spec": {"replicas": int(desired)}})
        log.info("scaled deployment %s/%s to %d replicas", self.namespace, name, desired)

    def cold_start_s(self, pool: PoolSpec) -> float | None:
        starts = self._cold_starts.get(pool.model)
        return max(starts) if starts else None
