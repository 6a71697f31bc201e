"""The cpu-dev overlay's pool pod serves and drains (issue 35): the smollm2 pool Deployment's pod template run as
local processes - the init container `stage-weights` (staging from the weights store the registry names), then
`triton` - each with exactly its manifest's command ($(VAR) expanded), env (ConfigMap, Secret, the pod name from
`fieldRef`), uid/gid, a mount namespace of its own with the pod's volumes (the projected report token written where
it is mounted) and a read-only root where the manifest says (tests/deploy/pod_harness.py). Beside it, in the same
network namespace: two real routers (their manifest's command, env and user; bound at two addresses that the
headless `llm-router-internal` resolves to), real PostgreSQL (unix socket), the Kubernetes API stand-in listing the
pod with its labels and IP, and the autoscaler's registrar (tests/deploy/pool_pod_run.py drives it all).

Checked: the registrar registers the pod from its labels; both routers get its signed reports (its key exchanged
for the pod's token) and each serves a streamed request through it; on termination the manifest's preStop makes
both routers see it draining, a new request is not routed to it while an in-flight stream finishes, and once the
pod is gone it is deregistered and no router routes to it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path


from common.settings import REPO_ROOT
from tests.deploy import pod_harness as harness
from tests.deploy.pod_harness import PG_SOCKET_DIR, SA_DIR
from tests.deploy.test_manifests import render

MODEL, VERSION = "smollm2-135m", "1"
POOL = f"llm-pool-{MODEL}-{VERSION}"
POD_NAME, POD_IP = f"{POOL}-7c9d5-x2k4p", "127.0.0.4"
ROUTER_IPS = ("127.0.0.2", "127.0.0.3")
# what the kubelet adds to every container: the API server's Service (the routers' TokenReview goes there)
KUBELET_ENV = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"}

pytestmark = harness.needs_namespaces


def _volume_dirs(root: Path, pod: dict, token: str | None = None) -> dict[str, Path]:
    """One host folder per volume of the pod, writable by its fsGroup as the kubelet makes it; a projected
    ServiceAccount token volume holds the token file."""
    group = pod["securityContext"].get("fsGroup", 0)
    out = {}
    for v in pod["volumes"]:
        path = root / v["name"]
        path.mkdir(parents=True)
        if "projected" in v:
            (path / v["projected"]["sources"][0]["serviceAccountToken"]["path"]).write_text(token or "")
            path.chmod(0o755)
        else:
            shutil.chown(path, group=group)
            path.chmod(0o2775)
        out[v["name"]] = path
    return out


def _prebuilt_kernels(image: Path) -> Path:
    """The engine's fused CPU kernels as an image build would leave them (built once on this machine)."""
    from python_backends.engine import cpu_kernels

    built = cpu_kernels.built_library()
    root = image / "torch_extensions"
    (root / built.parent.name).mkdir(parents=True)
    if built.exists():
        shutil.copy2(built, root / built.parent.name / built.name)
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    return root


def _seed(postgres_url: str, store: str, api_key: str) -> None:
    from registry import queries
    from registry.db import migrate, session_scope
    from tests.admin_ui.gate_reports import gate_report

    migrate(postgres_url)
    with session_scope(postgres_url) as s:
        queries.upsert_model_version(s, MODEL, VERSION, status="serving", max_context=2048, weights_uri=store,
                                     engine_kind="cpu", quality_gate=gate_report(0.97))
        queries.set_routes(s, MODEL, {VERSION: 100}, actor="test")
        queries.create_caller(s, "pool-pod-test", "team-a", api_key=api_key)


def test_pool_pod_registers_serves_through_both_routers_and_drains(pod_scratch, postgres_url, settings,
                                                                   smollm2_dir):
    work = pod_scratch
    from build_engines import stage
    from common.vendor import triton_env, triton_home

    store = work / "store" / MODEL / VERSION  # the weights store the registry names (a local one)
    stage.stage_to_store(smollm2_dir, str(store), stage.manifest_of(smollm2_dir))
    subprocess.run(["chmod", "-R", "a+rX", str(work / "store")], check=True)  # readable to the pod's user
    api_key = "sk-pool-pod-test"
    _seed(postgres_url, str(store), api_key)
    socket_url = f"postgresql+psycopg://postgres@/{postgres_url.rsplit('/', 1)[1]}?host={PG_SOCKET_DIR}"
    objects = render("cpu-dev")
    template = harness.pod_spec(objects, POOL)
    pod, stage_c = harness.container(objects, POOL, "stage-weights")
    _, triton = harness.container(objects, POOL, "triton")
    router_pod, router = harness.container(objects, "llm-router")
    overrides = {"db-url": socket_url, "replica-db-url": socket_url}
    image = settings.model_copy(update={"data_dir": work / "image"})
    (work / "image").mkdir()
    home = triton_home(image)  # the image's /opt/tritonserver
    image_env = {"PYTHONPATH": str(REPO_ROOT), "TORCH_EXTENSIONS_DIR": str(_prebuilt_kernels(work / "image")),
                 "PATH": f"/opt/tritonserver/bin:{REPO_ROOT / '.venv' / 'bin'}:/usr/bin:/bin",
                 "LD_LIBRARY_PATH": triton_env(image)["LD_LIBRARY_PATH"]}
    pod_token = "projected-token-of-" + POD_NAME
    volumes = _volume_dirs(work / "pod", pod, pod_token)
    stage_env = harness.env(objects, stage_c, overrides, POD_NAME)
    triton_values = dict(harness.env(objects, triton, overrides, POD_NAME), **KUBELET_ENV)
    plan = {
        "work": str(work), "model": MODEL, "version": VERSION, "pod_name": POD_NAME, "pod_ip": POD_IP,
        "pod_meta": {"labels": template["metadata"]["labels"], "annotations": template["metadata"]["annotations"]},
        "db_url": socket_url, "api_key": api_key, "pod_token": pod_token, "sa_token": "sa-token-of-llm-router",
        "viewer": harness.env(objects, router, {})["FLEET_VIEWER_TOKEN"], "long_tokens": 24,
        "stage": harness.run_as(pod, stage_c, stage_env, image_env={"PYTHONPATH": str(REPO_ROOT)}, volumes=volumes),
        "triton": harness.run_as(pod, triton, triton_values, image_env=image_env, volumes=volumes,
                                 image_dirs={"/opt/tritonserver": home}),
        "prestop": harness.run_as(pod, triton, triton_values, harness.command(triton["lifecycle"]["preStop"]["exec"],
                                                                              triton_values),
                                  image_env=image_env, volumes=volumes, image_dirs={"/opt/tritonserver": home}),
        "routers": [{"ip": ip, "cmd": harness.run_as(
            router_pod, router, dict(harness.env(objects, router, overrides), FLEET_ROUTER_HOST=ip,
                                     FLEET_ROUTER_INTERNAL_HOST=ip, **KUBELET_ENV),
            image_env={"PYTHONPATH": str(REPO_ROOT)}, volumes=_volume_dirs(work / f"router-{i}", router_pod))}
            for i, ip in enumerate(ROUTER_IPS)],
    }
    sa = work / "sa"
    sa.mkdir()
    plan["ca"], plan["tls_key"] = map(str, harness.self_signed(sa))
    (sa / "token").write_text(plan["sa_token"])
    (sa / "namespace").write_text("llm")
    (work / "plan.json").write_text(json.dumps(plan))
    # the headless Service of the routers: one address per router pod; the pod name for the pod's own address
    (work / "hosts").write_text(f"127.0.0.1 localhost\n{POD_IP} {POD_NAME}\n" + "".join(
        f"{ip} llm-router-internal llm-router\n" for ip in ROUTER_IPS))
    for path in harness.mount_points(stage_c, triton, router) | {SA_DIR, "/opt/tritonserver"}:
        Path(path).mkdir(parents=True, exist_ok=True)  # where the image has them: empty folders on the host
    script = "\n".join([
        "set -eu", "ip link set lo up",
        *harness.python_home_steps(work),
        f"mount --bind {work}/hosts /etc/hosts",
        f"mount -t tmpfs -o size=1m tmpfs {SA_DIR} && cp {sa}/ca.crt {sa}/token {sa}/namespace {SA_DIR}/",
        f"cd {REPO_ROOT}",
        f"{sys.executable} -m tests.deploy.pool_pod_run {work}/plan.json",
    ])
    done = subprocess.run(["unshare", "-mn", "--propagation", "private", "bash", "-c", script],
                          capture_output=True, text=True, timeout=240)
    logs = "\n".join(f"--- {p.name}\n" + "\n".join(line for line in p.read_text().splitlines()
                                                     if not line.startswith(("|", "+", "I1")))[-2500:]
                     for p in sorted(work.glob("*.log")))
    assert (work / "seen.json").exists(), f"the namespace script failed: {done.stderr[-3000:]}\n{logs}"
    seen = json.loads((work / "seen.json").read_text())
    print(json.dumps(seen, indent=1)[:6000])
    assert "failed" not in seen, f"{seen.get('failed')}\n{json.dumps(seen)[:3000]}\n{logs}"
    assert seen["stage"]["rc"] == 0
    assert seen["registered"] == {"state": "serving", "grpc_url": f"{POD_IP}:8001"}  # by the registrar, from labels
    for ip in ROUTER_IPS:
        assert seen["reports"][ip]["reporting"] and seen["reports"][ip]["draining"] is False, seen["reports"]
        served = seen["served"][ip]
        assert served["status"] == 200 and served["chunks"] >= 1 and served["generated"] >= 1, served
        assert seen["draining_seen"][ip] is not False
    assert seen["new_while_draining"]["status"] != 200 or seen["new_while_draining"]["chunks"] == 0
    assert seen["inflight_running_at_new"] is True
    assert seen["inflight"]["status"] == 200 and seen["inflight"]["finish"] == "length", seen["inflight"]
    assert seen["prestop_rc"] == 0 and seen["stream_done_before_prestop"] is True  # preStop waited for it
    assert seen["deregistered"] is True
    for ip in ROUTER_IPS:
        assert seen["after"][ip]["status"] != 200, seen["after"]
