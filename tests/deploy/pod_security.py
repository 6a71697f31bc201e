"""Pod Security Standards (https://kubernetes.io/docs/concepts/security/pod-security-standards/, v1.30+ rules)
checked per pod template: `violations(pod, "baseline")` / `violations(pod, "restricted")` list what the
admission controller at that level would refuse, one line per rule, written from the published control table."""
from __future__ import annotations

from typing import Any

BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod.get("initContainers", []) + pod.get("containers", []) + pod.get("ephemeralContainers", [])


def _baseline(pod: dict[str, Any]) -> list[str]:
    out = [f"host namespace {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    if pod.get("securityContext", {}).get("windowsOptions", {}).get("hostProcess"):
        out.append("hostProcess")
    out += [f"hostPath volume {v['name']}" for v in pod.get("volumes", []) if "hostPath" in v]
    for sysctl in pod.get("securityContext", {}).get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"unsafe sysctl {sysctl['name']}")
    contexts = [("pod", pod.get("securityContext", {}))]
    for c in _containers(pod):
        sc = c.get("securityContext", {})
        contexts.append((c["name"], sc))
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        extra = set(sc.get("capabilities", {}).get("add", [])) - BASELINE_CAPS
        if extra:
            out.append(f"{c['name']}: capabilities {sorted(extra)}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{c['name']}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{c['name']}: procMount {sc['procMount']}")
    for where, sc in contexts:
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            out.append(f"{where}: seccomp Unconfined")
        if sc.get("appArmorProfile", {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{where}: AppArmor {sc['appArmorProfile']['type']}")
        se = sc.get("seLinuxOptions", {})
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{where}: SELinux options {se}")
    return out


def _restricted(pod: dict[str, Any]) -> list[str]:
    out = [f"volume {v['name']} of a restricted type" for v in pod.get("volumes", [])
           if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    psc = pod.get("securityContext", {})
    if psc.get("runAsUser") == 0:
        out.append("pod: runAsUser 0")
    for c in _containers(pod):
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation not false")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            out.append(f"{c['name']}: runAsNonRoot not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{c['name']}: runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: seccomp {seccomp}")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{c['name']}: capabilities not dropping ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{c['name']}: capabilities add {caps['add']}")
    return out


def violations(pod: dict[str, Any], level: str) -> list[str]:
    """What Pod Security Admission at `level` (baseline | restricted) refuses in this pod spec."""
    if level not in ("baseline", "restricted"):
        raise ValueError(f"level {level!r}: must be baseline or restricted")
    return _baseline(pod) + (_restricted(pod) if level == "restricted" else [])
