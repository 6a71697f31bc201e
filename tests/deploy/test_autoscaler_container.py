"""The autoscaler container runs as its manifest says, and survives: its own command, the rendered manifest's
env (ConfigMap + Secret), uid/gid 10001, a read-only root with only the manifest's volumes writable (tmpfs),
the ServiceAccount token mounted where Kubernetes mounts it, `llm-router` resolving as the cluster's DNS would.
Behind it: the real router (its own manifest's command, env and user), the real PostgreSQL (unix socket) and a
Kubernetes API stand-in (tests/deploy/kube_api_standin.py: TLS, bearer token, the API server's name
validation; no kube-apiserver can run here). Linux namespaces (`unshare -mn`, as root) stand in for Docker.

It must make a scale decision (the decisions file under FLEET_DATA_DIR: the write that crashed it), apply the
pool `meta-llama/Llama-3.1-70B` version `v2+lora` under a name the API server accepts, and keep running while
another pool's API calls fail (500). It leaves empty mount-point directories on the host (/data/fleet, the
ServiceAccount folder under /var/run/secrets) where the image would have them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


from common.settings import REPO_ROOT
from tests.deploy import pod_harness as harness
from tests.deploy.pod_harness import PG_SOCKET_DIR, SA_DIR
from tests.deploy.test_manifests import render

HOSTILE = ("meta-llama/Llama-3.1-70B", "v2+lora")
BROKEN = ("broken-model", "1")
RUN_S = 15  # the manifest's 2 s interval: several ticks after start-up even on a loaded machine

pytestmark = harness.needs_namespaces


def test_autoscaler_container_makes_and_survives_scale_decisions(pod_scratch, postgres_url) -> None:
    tmp_path = pod_scratch
    from registry import queries
    from registry.db import migrate, session_scope
    from registry.warm_buffers import set_warm_buffer

    migrate(postgres_url)
    with session_scope(postgres_url) as s:
        for model, version in (HOSTILE, BROKEN):
            queries.upsert_model_version(s, model, version, status="serving", tensor_parallel=4)
            set_warm_buffer(s, model, version, min_idle_replicas=0, min_replicas=1, max_replicas=2,
                            slo_ttft_ms_p95=2000, slo_tokens_per_s=20, actor="test")
    db_name = postgres_url.rsplit("/", 1)[1]
    socket_url = f"postgresql+psycopg://postgres@/{db_name}?host={PG_SOCKET_DIR}"
    objects = render("cpu-dev")  # the overlay with a committed (dev) Secret
    overrides = {"db-url": socket_url}
    as_pod, autoscaler = harness.container(objects, "llm-autoscaler")
    router_pod, router = harness.container(objects, "llm-router")
    assert autoscaler["securityContext"]["readOnlyRootFilesystem"] and as_pod["securityContext"]["runAsUser"] == 10001
    as_env = dict(harness.env(objects, autoscaler, overrides), KUBERNETES_SERVICE_HOST="127.0.0.1",
                  KUBERNETES_SERVICE_PORT="6443")
    # mount points the namespaces need on the host's (shared) file system: empty directories
    for path in {m["mountPath"] for m in autoscaler["volumeMounts"] + router["volumeMounts"]} | {SA_DIR}:
        Path(path).mkdir(parents=True, exist_ok=True)
    sa = tmp_path / "sa"
    sa.mkdir()
    cert, key = harness.self_signed(sa)
    (sa / "token").write_text("sa-token-of-llm-autoscaler")
    (sa / "namespace").write_text("llm")
    (tmp_path / "hosts").write_text("127.0.0.1 localhost llm-router llm-router-internal\n")
    api_log = tmp_path / "api.jsonl"
    out = tmp_path / "out"
    out.mkdir()
    script = "\n".join([
        "set -u", "ip link set lo up",
        f"mount --bind {tmp_path} {tmp_path}",  # the test's own files stay writable; / becomes read-only
        *harness.python_home_steps(tmp_path),
        "mount --bind / / && mount -o remount,bind,ro /",
        f"mount --bind {tmp_path}/hosts /etc/hosts",
        f"mount -t tmpfs -o size=1m tmpfs {SA_DIR} && cp {sa}/ca.crt {sa}/token {sa}/namespace {SA_DIR}/",
        *harness.emptydir_tmpfs(as_pod, autoscaler), *harness.emptydir_tmpfs(router_pod, router),
        f"cd {REPO_ROOT}",
        f"{sys.executable} -m tests.deploy.kube_api_standin --port 6443 --cert {cert} --key {key} "
        f"--token {sa}/token --log {api_log} & API=$!",
        f"{harness.run_as(router_pod, router, harness.env(objects, router, overrides))} > {out}/router.log 2>&1 & ROUTER=$!",
        "for i in $(seq 100); do "
        f"{sys.executable} -c \"import urllib.request; urllib.request.urlopen('http://llm-router:8030/health', timeout=1)\" "
        "2>/dev/null && break; sleep 0.2; done",
        f"timeout -s TERM {RUN_S} {harness.run_as(as_pod, autoscaler, as_env)} > {out}/autoscaler.log 2>&1; "
        f"echo $? > {out}/rc",
        f"cp -r /data/fleet/autoscale {out}/ 2>/dev/null; kill $ROUTER $API; wait",
    ])
    done = subprocess.run(["unshare", "-mn", "--propagation", "private", "bash", "-c", script],
                          capture_output=True, text=True, timeout=RUN_S + 60)
    log = (out / "autoscaler.log").read_text() if (out / "autoscaler.log").exists() else ""
    assert (out / "rc").exists(), f"the namespace script failed: {done.stderr[-3000:]}"
    rc = (out / "rc").read_text().strip()
    assert rc == "124", f"the autoscaler exited (rc {rc}) before its time was up:\n{log[-3000:]}"
    decisions = [json.loads(line) for line in (out / "autoscale" / "decisions.jsonl").read_text().splitlines()]
    pools = {d["pool"] for d in decisions}
    assert any(p.startswith("meta-llama") for p in pools), (pools, log[-2000:])
    calls = [json.loads(line) for line in api_log.read_text().splitlines()]
    applied = [c for c in calls if c["method"] == "PATCH" and "fieldManager" in c["query"]]
    hostile = [c for c in applied if c["sent"]["metadata"]["annotations"]["fleet.ai/model"] == HOSTILE[0]]
    assert hostile and hostile[0]["code"] == 201, hostile  # the API server's validation accepted the names
    assert hostile[0]["sent"]["spec"]["replicas"] == 1
    broken = [c for c in applied if c["sent"]["metadata"]["annotations"]["fleet.ai/model"] == BROKEN[0]]
    assert len(broken) >= 2 and {c["code"] for c in broken} == {500}  # retried on later ticks: still alive
    assert "tick failed" in log
    assert all(c["code"] != 401 for c in calls)  # the mounted ServiceAccount token was used
    print(log[-4000:])  # shown with -s: what the container logged
