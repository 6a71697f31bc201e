"""Run a rendered manifest's container as a local process, the way the kubelet would start it, without Docker:
its exact command (with `$(VAR)` expanded from its env, as the kubelet does), only its env (ConfigMap, Secret,
`fieldRef: metadata.name`), its user and group (`setpriv`), and - with `own_mounts` - a mount namespace of its own
(`unshare -m`) holding its volumes at their mount paths and a read-only root where the manifest says so.

Used by the autoscaler container test and the pool pod test (tests/deploy/test_autoscaler_container.py,
tests/deploy/test_pool_pod.py); both run as root inside a network namespace (`unshare -mn`)."""
from __future__ import annotations

import base64
import datetime
import ipaddress
import re
import shlex
import shutil
import tempfile
from pathlib import Path

import pytest

from common.settings import REPO_ROOT

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
PG_SOCKET_DIR = Path("/var/run/postgresql")  # Debian's: the netns has no 127.0.0.1:5432 of the host
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def can_run() -> bool:
    """Root, unshare, setpriv and PostgreSQL's unix socket: what these tests need instead of a container runtime."""
    import os

    return (os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("setpriv") is not None
            and (PG_SOCKET_DIR / ".s.PGSQL.5432").exists())


needs_namespaces = pytest.mark.skipif(not can_run(), reason="needs root, unshare and setpriv (Linux namespaces "
                                      "stand in for a container runtime) and PostgreSQL's unix socket")


def work_dir(prefix: str) -> Path:
    """Outside /tmp (containers get their own tmpfs /tmp) and world-readable (the containers' users read it)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    path.chmod(0o755)
    return path


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A CA certificate for 127.0.0.1 (the API stand-in's) and its key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    (folder / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    return folder / "ca.crt", folder / "tls.key"


def pod_spec(objects: list[dict], deployment: str) -> dict:
    """The Deployment's pod template (metadata and spec)."""
    dep = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == deployment)
    return dep["spec"]["template"]


def container(objects: list[dict], deployment: str, name: str | None = None) -> tuple[dict, dict]:
    """(pod spec, container): the named container or init container, else the first container."""
    spec = pod_spec(objects, deployment)["spec"]
    every = spec.get("initContainers", []) + spec["containers"]
    return spec, next(c for c in every if c["name"] == name) if name else spec["containers"][0]


def env(objects: list[dict], c: dict, secret_overrides: dict[str, str], pod_name: str = "") -> dict[str, str]:
    """The container's env as the kubelet builds it: envFrom ConfigMaps, then `env` (values, Secret keys,
    `metadata.name`). The usage lake's object-store Secret (envFrom) stays unset here: the local lake is used."""
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    secrets = {o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in o.get("data", {}).items()}
               for o in objects if o["kind"] == "Secret"}
    out: dict[str, str] = {}
    for ref in c.get("envFrom", []):
        if "configMapRef" in ref:
            out.update(maps[ref["configMapRef"]["name"]])
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = VAR_REF.sub(lambda m: out.get(m.group(1), m.group(0)), e["value"])
            continue
        ref = e["valueFrom"]
        if "fieldRef" in ref:
            assert ref["fieldRef"]["fieldPath"] == "metadata.name", f"{e['name']}: only metadata.name is emulated"
            out[e["name"]] = pod_name
        else:
            key = ref["secretKeyRef"]
            out[e["name"]] = secret_overrides.get(key["key"], secrets[key["name"]][key["key"]])
    return out


def command(c: dict, values: dict[str, str], key: str = "command") -> list[str]:
    """The container's command (or a preStop's), `$(VAR)` expanded from its env; an unknown one stays as written."""
    return [VAR_REF.sub(lambda m: values.get(m.group(1), m.group(0)), a) for a in c[key]]


def run_as(pod: dict, c: dict, values: dict[str, str], argv: list[str] | None = None,
           image_env: dict[str, str] | None = None, volumes: dict[str, Path] | None = None,
           image_dirs: dict[str, Path] | None = None) -> str:
    """A shell command line: `argv` (default the container's command) under the container's user, with only its
    env plus what the image and the kubelet add. With `volumes` (volume name -> host folder), in a mount
    namespace of its own: each mount at its path (read-only where the mount says), then a read-only root where
    `readOnlyRootFilesystem` is set; `image_dirs` (container path -> host folder) are what the image would hold
    there (e.g. /opt/tritonserver)."""
    sc = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
    full = {"PATH": f"{REPO_ROOT / '.venv' / 'bin'}:/usr/bin:/bin", "HOME": "/", **(image_env or {}), **values}
    line = (f"setpriv --reuid={sc['runAsUser']} --regid={sc['runAsGroup']} --clear-groups "
            f"env -i {' '.join(shlex.quote(f'{k}={v}') for k, v in full.items())} "
            f"{shlex.join(argv if argv is not None else command(c, values))}")
    if volumes is None:
        return line
    steps = [f"mount --bind {src} {dst}" for dst, src in (image_dirs or {}).items()]
    for m in c.get("volumeMounts", []):
        steps.append(_over(m["mountPath"], f"mount --bind {volumes[m['name']]} {m['mountPath']}"))
        if m.get("readOnly"):
            steps.append(f"mount -o remount,bind,ro {m['mountPath']}")
    if sc.get("readOnlyRootFilesystem"):
        steps.append("mount --bind / / && mount -o remount,bind,ro /")
    script = " && ".join(steps + [f"exec {line}"])
    return f"unshare -m --propagation private bash -c {shlex.quote(script)}"


def mount_points(*containers: dict) -> set[str]:
    """The mount paths, to exist as empty folders on the host where the image would have them."""
    return {m["mountPath"] for c in containers for m in c.get("volumeMounts", [])}


def _over(mount_path: str, mount: str) -> str:
    """`mount` (a shell step putting something at `mount_path`); where that hides this checkout (a clone under
    /tmp, where the pod mounts its /tmp, or under /root, hidden for the Python home), the checkout is bound
    back at its path - the image would hold it elsewhere. File descriptor 9 keeps the hidden folder reachable (`mount -c`: not canonicalised to the new one)."""
    if not REPO_ROOT.is_relative_to(mount_path) or Path(mount_path) == REPO_ROOT:
        return mount
    return (f"exec 9<{REPO_ROOT} && {mount} && mkdir -p {REPO_ROOT} && "
            f"mount -c --bind /proc/self/fd/9 {REPO_ROOT} && exec 9<&-")


def emptydir_tmpfs(pod: dict, c: dict) -> list[str]:
    """Shell steps: a tmpfs at every emptyDir mount of `c` (owned by fsGroup, as the kubelet makes it)."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    group = pod["securityContext"].get("fsGroup", 0)
    out = []
    for m in c.get("volumeMounts", []):
        assert "emptyDir" in volumes[m["name"]], f"{m['name']}: only emptyDir volumes are emulated here"
        out.append(f"mkdir -p {m['mountPath']} 2>/dev/null || true; " + _over(
            m["mountPath"], f"mount -t tmpfs -o size=64m,mode=2775,gid={group} tmpfs {m['mountPath']}"))
    return out


def python_home_steps(tmp_path: Path) -> list[str]:
    """Shell steps: this machine's Python lives under /root (mode 0700); an image's is world-readable: show only
    it to the containers' users."""
    return [
        f"PYHOME=$(readlink -f {REPO_ROOT}/.venv/bin/python3 | sed 's|^\\(/root/[^/]*\\)/.*|\\1|')",
        f'case "$PYHOME" in /root/*) mkdir -p {tmp_path}/pyhome && mount --bind "$PYHOME" {tmp_path}/pyhome && '
        f'{_over("/root", "mount -t tmpfs -o size=1m,mode=0755 tmpfs /root")} && mkdir -p "$PYHOME" && '
        f'mount --bind {tmp_path}/pyhome "$PYHOME";; esac',
    ]
