"""Kubernetes actuator and GPU-replica registrar: one Deployment per model pool, scaled through `scale`.

One way a GPU replica joins the fleet, whether an overlay or this actuator made its Deployment: its pod
carries the documented label set

    app.kubernetes.io/name=llm-replica, fleet.ai/pool=<pool_label(model, version)>

(and annotations `fleet.ai/model`, `fleet.ai/version` with the exact, unsanitised names); the overlays' pools
carry the same labels (deploy/overlays/*/pool-*/kustomization.yaml), and `tests/deploy/test_production_shape.py`
checks that both sides agree. Every tick `counts` lists each managed pool's pods and registers them in the
registry, so routers route to them: replica id = pod name, gRPC at `podIP:8001`, state `serving` once the pod is
Ready, `starting` before, `draining` once Kubernetes is deleting it (its preStop drain runs); rows of vanished
pods are deleted (deregistration).

- `scale` PATCHes the Deployment's `scale` subresource. A pool with no Deployment yet (a new version in a
  rollout) is created by server-side apply (`ensure_workload`, field manager `llm-autoscaler`) from the pod
  template of the model's Deployment the overlay deployed (so its image, placement and secrets are the
  overlay's), else from deploy/base/pool/deployment.yaml with `--image`. The Deployment's name is the overlay's
  (`llm-pool-<pool label>`), so the actuator never makes a second Deployment beside an overlay's. On start
  (`adopt`) Deployments the actuator created are re-applied, so a changed template or image rolls out.
- Names are sanitised (autoscale/actuators/k8s_names.py): `meta-llama/Llama-3.1-70B` version `v2+lora` gets a
  valid Deployment name and label value.
- Healing (docs/reliability.md, Self-healing): a pod a router cordoned keeps its `cordoned` row (the registrar
  does not overwrite it with `serving`), counts as missing capacity (the Deployment is scaled past it), and is
  deleted once it stayed cordoned for `restart_cordoned_after_s` (its probes kept failing; autoscale/actuators/
  healing.py): its ReplicaSet starts a fresh pod in its place.
- Cold starts are measured from pod status: the Ready condition's lastTransitionTime minus the pod's creation
  (scheduling, image pull, weight staging, engine load), once per pod; `cold_start_s` is their p90.
"""
from __future__ import annotations

import copy
import logging
import math
from datetime import datetime
from typing import Any

import yaml

from autoscale.actuators import PoolSpec, ReplicaCounts
from autoscale.actuators.healing import CordonWatch, cordoned_replicas
from autoscale.actuators.k8s_names import deployment_name as _deployment_name
from autoscale.actuators.k8s_names import label_value, pool_label
from common.gpu_info import node_selector
from common.settings import REPO_ROOT

log = logging.getLogger(__name__)

POOL_TEMPLATE = REPO_ROOT / "deploy" / "base" / "pool" / "deployment.yaml"
APP_LABEL, REPLICA_APP = "app.kubernetes.io/name", "llm-replica"
POOL_LABEL = "fleet.ai/pool"
MANAGED_BY_LABEL, FIELD_MANAGER = "app.kubernetes.io/managed-by", "llm-autoscaler"
MODEL_ANNOTATION, VERSION_ANNOTATION = "fleet.ai/model", "fleet.ai/version"
DEFAULT_IMAGE = "registry.example.com/llm-fleet-gpu:0.1.0-trtllm0.17"  # used only without an overlay's pool
GRPC_PORT, HTTP_PORT, METRICS_PORT = 8001, 8000, 8002
POOL_ENV = ("FLEET_MODEL", "FLEET_VERSION", "FLEET_TENSOR_PARALLEL", "FLEET_REGION")


def deployment_name(pool: PoolSpec) -> str:
    return _deployment_name(pool.model, pool.version)


def pool_selector(pool: PoolSpec) -> str:
    """The label selector of the pool's pods (the registrar's and the Deployment's)."""
    return f"{APP_LABEL}={REPLICA_APP},{POOL_LABEL}={pool_label(pool.model, pool.version)}"


def deployment_manifest(pool: PoolSpec, namespace: str, image: str = DEFAULT_IMAGE, replicas: int | None = None,
                        template: dict[str, Any] | None = None,
                        build_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pool's Deployment (apps/v1) as a plain dict: `template` (an existing Deployment of the model, as the
    overlay deployed it) or the base pool file with `image`, set to this pool's model, version, tensor
    parallelism (GPUs + MPI ranks), labels and annotations, and pinned to the GPU product the version's engine
    was built on (`build_info["gpu"]`, common/gpu_info.py), whatever product the template names."""
    base = template if template is not None else yaml.safe_load(POOL_TEMPLATE.read_text())
    source = copy.deepcopy(base)  # deep copy: the template shares its env between containers
    labels = {APP_LABEL: REPLICA_APP, POOL_LABEL: pool_label(pool.model, pool.version),
              "fleet.ai/region": label_value(pool.region), MANAGED_BY_LABEL: FIELD_MANAGER}
    annotations = {MODEL_ANNOTATION: pool.model, VERSION_ANNOTATION: pool.version}
    spec = {k: v for k, v in source["spec"].items() if k not in ("replicas", "selector", "template")}
    pod_meta = source["spec"]["template"].get("metadata") or {}
    pod = source["spec"]["template"]["spec"]
    tp = str(pool.tensor_parallel)
    for container in pod.get("initContainers", []) + pod["containers"]:
        if template is None:
            container["image"] = image
        env = [e for e in container.get("env", []) if e["name"] not in POOL_ENV]
        if container["name"] != "state":
            env = [{"name": "FLEET_MODEL", "value": pool.model}, {"name": "FLEET_VERSION", "value": pool.version},
                   {"name": "FLEET_TENSOR_PARALLEL", "value": tp}] + env
        container["env"] = env + [{"name": "FLEET_REGION", "value": pool.region}]
        resources = container.setdefault("resources", {})
        if container["name"] == "triton" and (template is None or "nvidia.com/gpu" in resources.get("limits", {})):
            for kind in ("requests", "limits"):  # a CPU pool's template (cpu-dev) stays without GPUs
                resources.setdefault(kind, {})["nvidia.com/gpu"] = tp
    pod_labels = {k: v for k, v in (pod_meta.get("labels") or {}).items() if k != POOL_LABEL}
    pod_annotations = dict(pod_meta.get("annotations") or {}, **annotations)
    if template is None:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    _retarget_spread(pod, labels[POOL_LABEL])
    pin = node_selector(build_info)
    if pin:
        pod["nodeSelector"] = dict(pod.get("nodeSelector") or {}, **pin)
    spec["selector"] = {"matchLabels": {APP_LABEL: REPLICA_APP, POOL_LABEL: labels[POOL_LABEL]}}
    spec["template"] = {"metadata": {"labels": dict(pod_labels, **labels), "annotations": pod_annotations},
                        "spec": pod}
    if replicas is not None:
        spec["replicas"] = int(replicas)
    meta_labels = dict((source.get("metadata") or {}).get("labels") or {}, **labels)
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": deployment_name(pool), "namespace": namespace, "labels": meta_labels,
                         "annotations": annotations},
            "spec": spec}


def _retarget_spread(pod: dict[str, Any], label: str) -> None:
    """Topology spread of a copied template selects this pool's pods, not the source pool's."""
    for rule in pod.get("topologySpreadConstraints", []):
        match = rule.get("labelSelector", {}).get("matchLabels", {})
        if POOL_LABEL in match:
            match[POOL_LABEL] = label


def _ready_at(pod: Any) -> datetime | None:
    for cond in (pod.status.conditions or []) if pod.status else []:
        if cond.type == "Ready" and cond.status == "True":
            return cond.last_transition_time
    return None


def _plain(api_client: Any, obj: Any) -> dict[str, Any]:
    return api_client.sanitize_for_serialization(obj)


class KubernetesActuator:
    """Scales one Deployment per pool and registers its pods. `api_client` lets tests point it at a server."""

    def __init__(self, namespace: str = "llm", api_client: Any | None = None, image: str | None = None,
                 db_url: str | None = None, restart_cordoned_after_s: float = 120.0) -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.api_client = api_client
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace, self.image, self.db_url = namespace, image or DEFAULT_IMAGE, db_url
        self._cold_starts: dict[str, list[float]] = {}
        self._measured: set[str] = set()
        self.cordons = CordonWatch(restart_cordoned_after_s)
        self._cordoned: dict[PoolSpec, int] = {}  # pods of the pool a router cordoned, at the last count

    def _model_template(self, pool: PoolSpec) -> dict[str, Any] | None:
        """The model's Deployment an overlay deployed (not one this actuator made), as a plain dict."""
        items = self.apps.list_namespaced_deployment(self.namespace, label_selector=f"{APP_LABEL}={REPLICA_APP}").items
        for want_overlay in (True, False):
            for dep in items:
                meta = dep.metadata
                if ((meta.annotations or {}).get(MODEL_ANNOTATION) == pool.model
                        and ((meta.labels or {}).get(MANAGED_BY_LABEL) != FIELD_MANAGER) == want_overlay
                        and meta.name != deployment_name(pool)):
                    return _plain(self.api_client, dep)
        return None

    def _build_info(self, pool: PoolSpec) -> dict[str, Any] | None:
        """The version's build info from the registry (its engine's GPU), None where the registry has no row."""
        from registry import queries
        from registry.db import session_scope

        if self.db_url is None:
            from common.settings import load_settings
            self.db_url = load_settings().db_url
        with session_scope(self.db_url) as s:
            row = queries.get_model_version(s, pool.model, pool.version)
            return dict(row.build_info or {}) if row is not None else None

    def ensure_workload(self, pool: PoolSpec, replicas: int | None = None) -> str:
        """Server-side apply the pool's Deployment (creates it, or rolls out a changed template)."""
        name = deployment_name(pool)
        manifest = deployment_manifest(pool, self.namespace, self.image, replicas, self._model_template(pool),
                                       self._build_info(pool))
        self.apps.patch_namespaced_deployment(name, self.namespace, manifest, field_manager=FIELD_MANAGER,
                                              force=True, _content_type="application/apply-patch+yaml")
        log.info("applied deployment %s/%s (replicas %s)", self.namespace, name, replicas)
        return name

    def adopt(self, pool: PoolSpec) -> None:
        """Re-apply a Deployment this actuator created, so a changed template rolls out; overlays' are theirs."""
        from kubernetes.client.exceptions import ApiException

        try:
            dep = self.apps.read_namespaced_deployment(deployment_name(pool), self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return
        if (dep.metadata.labels or {}).get(MANAGED_BY_LABEL) == FIELD_MANAGER:
            self.ensure_workload(pool, replicas=dep.spec.replicas)

    def counts(self, pool: PoolSpec) -> ReplicaCounts:
        """Replica counts from the scale and the pool's pods; registers the pods on the way."""
        from kubernetes.client.exceptions import ApiException

        try:
            scale = self.apps.read_namespaced_deployment_scale(deployment_name(pool), self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return ReplicaCounts()  # not created yet: the first scale() creates it
        desired = scale.spec.replicas or 0
        states = self.sync_replicas(pool)
        serving = sum(1 for s in states.values() if s == "serving")
        # terminating pods are out of the Deployment's status counts: count them from the pods themselves
        draining = sum(1 for s in states.values() if s == "draining")
        # cordoned pods hold Deployment slots but serve nothing: missing capacity, not counted as serving
        cordoned = self._cordoned[pool] = sum(1 for s in states.values() if s == "cordoned")
        return ReplicaCounts(serving=min(serving, max(desired - cordoned, 0)),
                             starting=max(desired - cordoned - serving, 0), draining=draining, cordoned=cordoned)

    def scale(self, pool: PoolSpec, desired: int) -> None:
        from kubernetes.client.exceptions import ApiException

        name = deployment_name(pool)
        desired = int(desired) + self._cordoned.get(pool, 0)  # a cordoned pod's slot is not capacity
        try:
            self.apps.patch_namespaced_deployment_scale(name, self.namespace, {"spec": {"replicas": desired}})
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.ensure_workload(pool, replicas=desired)
            return
        log.info("scaled deployment %s/%s to %d replicas", self.namespace, name, desired)

    def _registry_url(self) -> str:
        if self.db_url is None:
            from common.settings import load_settings
            self.db_url = load_settings().db_url
        return self.db_url

    def pool_pods(self, pool: PoolSpec) -> list[Any]:
        return self.core.list_namespaced_pod(self.namespace, label_selector=pool_selector(pool)).items

    def sync_replicas(self, pool: PoolSpec) -> dict[str, str]:
        """Register the pool's pods (pod IPs) for the routers; record cold starts. Returns pod name -> state."""
        from registry import queries
        from registry.db import session_scope

        states: dict[str, dict[str, Any]] = {}
        for pod in self.pool_pods(pool):
            notes = pod.metadata.annotations or {}
            if notes.get(MODEL_ANNOTATION, pool.model) != pool.model or \
                    notes.get(VERSION_ANNOTATION, pool.version) != pool.version:
                log.warning("pod %s carries pool label %s but serves %s/%s: not registered", pod.metadata.name,
                            pool_label(pool.model, pool.version), notes.get(MODEL_ANNOTATION), notes.get(VERSION_ANNOTATION))
                continue
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
        with session_scope(self._registry_url()) as s:
            rows = {r.replica_id: r for r in queries.list_replicas(s, pool.model) if r.version == pool.version}
            for replica_id, row in rows.items():
                if replica_id not in states:
                    queries.delete_replica(s, replica_id)
            for replica_id, fields in states.items():
                row = rows.get(replica_id)
                if row is not None and row.state == "cordoned" and fields["state"] == "serving":
                    fields["state"] = "cordoned"  # a router's cordon stands until its probe or a restart
                if row is None or any(getattr(row, k) != v for k, v in fields.items()):
                    queries.upsert_replica(s, replica_id, **fields)  # unchanged rows: no registry version bump
        return {k: v["state"] for k, v in states.items()}

    def heal(self, pool: PoolSpec) -> list[str]:
        """Delete the pool's pods a router cordoned and that stayed cordoned for restart_cordoned_after_s (their
        probes kept failing): the ReplicaSet replaces each with a fresh pod. Returns the deleted pods' names."""
        running = [p.metadata.name for p in self.pool_pods(pool) if p.metadata.deletion_timestamp is None]
        db_url = self._registry_url()
        stuck = self.cordons.due(db_url, running, cordoned_replicas(db_url, pool.model, pool.version))
        for name in stuck:
            log.warning("pod %s stayed cordoned by a router (its probes keep failing): deleting it so its "
                        "ReplicaSet starts a fresh one", name)
            self.core.delete_namespaced_pod(name, self.namespace)
        return stuck

    def cold_start_s(self, pool: PoolSpec) -> float | None:
        starts = sorted(self._cold_starts.get(pool.model, []))
        return starts[min(len(starts) - 1, math.ceil(0.9 * len(starts)) - 1)] if starts else None
