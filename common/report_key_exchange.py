"""How a Kubernetes pod gets its own report key without ever holding the fleet's report secret.

A replica's report key is `replica_key(secret, replica_id)` (common/report_channel.py) and a GPU pod's replica
id is its pod name, known only once the pod exists, so no Secret in the pod spec can carry it. Instead the pod
proves who it is: the kubelet mounts a projected ServiceAccount token for the audience `llm-fleet-report`
(bound to the pod: the API server writes the pod's name and uid into it and rejects it once the pod is gone).
The pod's `state` sidecar POSTs that token to a router's internal listener (`KEY_PATH`); the router asks the
API server (`TokenReview`, authentication.k8s.io/v1) who the token belongs to and, only for the replica
ServiceAccount of its own namespace, answers with the key of the pod the token names. So a pod learns its
own key and no other: with it, it cannot sign a report for another replica (the routers derive the key
from the claimed replica id), and it holds neither the fleet-wide secret nor any other credential.

Server side: `TokenReviewer.pod_of(token)`; client side: `fetch_report_key(router_url, token_file)`.
"""
from __future__ import annotations

import json
import ssl
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

from common.settings import load_from_env

KEY_PATH = "/internal/report-key"
AUDIENCE = "llm-fleet-report"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"  # what the API server puts in a pod-bound token's review
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MAX_TOKEN_BYTES = 16_384  # a projected token is ~1 kB; anything far larger is refused unread


class KubeServiceEnv(BaseSettings):
    """Where the kubelet says the API server is (every container gets these two variables)."""
    model_config = SettingsConfigDict(extra="ignore", frozen=True)

    kubernetes_service_host: str = ""
    kubernetes_service_port: int = 443


class KeyExchangeError(ValueError):
    """A token the API server does not vouch for, or not a replica pod's."""


@dataclass(frozen=True)
class TokenReviewer:
    """Asks the API server who a pod-bound token belongs to (the router's own ServiceAccount token authorises
    the call; RBAC: `create` on `tokenreviews`, nothing else)."""
    api_url: str
    namespace: str
    token_file: Path = SA_DIR / "token"
    ca_file: Path | None = SA_DIR / "ca.crt"
    service_account: str = "llm-replica"
    audience: str = AUDIENCE

    @classmethod
    def in_cluster(cls) -> "TokenReviewer | None":
        """The reviewer of a pod with a ServiceAccount token mounted; None outside Kubernetes (no key exchange)."""
        env = load_from_env(KubeServiceEnv)
        host, port = env.kubernetes_service_host, env.kubernetes_service_port
        if not host or not (SA_DIR / "token").exists():
            return None
        netloc = f"[{host}]" if ":" in host else host
        return cls(f"https://{netloc}:{port}", (SA_DIR / "namespace").read_text().strip())

    def pod_of(self, token: str, timeout_s: float = 5.0) -> str:
        """The name of the replica pod `token` was issued to; KeyExchangeError otherwise."""
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                  "spec": {"token": token, "audiences": [self.audience]}}
        req = urllib.request.Request(
            f"{self.api_url}/apis/authentication.k8s.io/v1/tokenreviews", data=json.dumps(review).encode(),
            method="POST", headers={"content-type": "application/json",
                                    "authorization": f"Bearer {self.token_file.read_text().strip()}"})
        ctx = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:
            status = json.loads(resp.read()).get("status", {})
        if not status.get("authenticated"):
            raise KeyExchangeError(f"token: not authenticated by the API server ({status.get('error') or 'no reason'})")
        if self.audience not in (status.get("audiences") or []):
            raise KeyExchangeError(f"token: not issued for the audience {self.audience!r}")
        user = status.get("user", {})
        want = f"system:serviceaccount:{self.namespace}:{self.service_account}"
        if user.get("username") != want:
            raise KeyExchangeError(f"token: belongs to {user.get('username')!r}; only {want!r} gets report keys")
        pods = (user.get("extra") or {}).get(POD_NAME_EXTRA) or []
        if len(pods) != 1 or not pods[0]:
            raise KeyExchangeError("token: not bound to a pod (mount a projected serviceAccountToken volume)")
        return pods[0]


def fetch_report_key(router_url: str, token_file: Path, timeout_s: float = 10.0) -> tuple[str, str]:
    """(replica id, report key) from a router's internal listener, for the pod whose token `token_file` holds."""
    req = urllib.request.Request(router_url.rstrip("/") + KEY_PATH, data=b"{}", method="POST",
                                 headers={"content-type": "application/json",
                                          "authorization": f"Bearer {token_file.read_text().strip()}"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        answer = json.loads(resp.read())
    return str(answer["replica_id"]), str(answer["report_key"])
