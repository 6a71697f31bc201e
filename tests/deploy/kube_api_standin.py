"""A Kubernetes API stand-in for the autoscaler container test (no kube-apiserver can run here): HTTPS with a
CA the client must verify, the ServiceAccount bearer token required on every call, and the apps/v1 Deployment
and core/v1 Pod endpoints the actuator uses, answering as the API reference documents - including the
API server's validation of names and label values (422 Invalid), which is what killed the autoscaler before.
TokenReview (authentication.k8s.io/v1) answers for the tokens in `TOKENS` (token -> the ServiceAccount, pod
and audiences the API server would have bound it to), as the API reference documents: unauthenticated for an
unknown token or one whose audiences do not meet the review's. Pods are those in `PODS` (the pool pod test puts
its local pod there, acting as the kubelet), filtered by the `labelSelector` (equality terms) as the API server
does. Deployments whose `fleet.ai/model` annotation is in FAIL_MODELS get a 500 (one pool's outage). Every request
is appended with its answer's status code as one JSON line to the log file.

    python -m tests.deploy.kube_api_standin --port 6443 --cert c.pem --key k.pem --token T --log api.jsonl
"""
from __future__ import annotations

import argparse
import json
import re
import ssl
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
FAIL_MODELS = {"broken-model"}
DEPLOYMENTS: dict[str, dict] = {}
TOKENS: dict[str, dict] = {}  # token -> {"username": ..., "pod": ..., "audiences": [...]}
PODS: dict[str, dict] = {}  # pod name -> the Pod object (metadata, spec, status)


def selected(pod: dict, selector: str) -> bool:
    """Whether the pod's labels meet an equality-based label selector (`a=b,c=d`)."""
    labels = pod.get("metadata", {}).get("labels", {})
    terms = [t.split("=", 1) for t in selector.split(",") if t]
    return all(labels.get(k.strip()) == v.strip().lstrip("=") for k, v in terms)


def invalid(dep: dict) -> list[str]:
    """What the API server's Deployment validation refuses among names and labels."""
    out = []
    name = dep.get("metadata", {}).get("name", "")
    if len(name) > 63 or not DNS_LABEL.match(name):
        out.append(f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 label must consist of lower case "
                   "alphanumeric characters or '-', and must start and end with an alphanumeric character")
    spec = dep.get("spec", {})
    labelled = [("metadata.labels", dep.get("metadata", {}).get("labels", {})),
                ("spec.selector.matchLabels", spec.get("selector", {}).get("matchLabels", {})),
                ("spec.template.metadata.labels", spec.get("template", {}).get("metadata", {}).get("labels", {}))]
    for where, labels in labelled:
        for key, value in labels.items():
            if len(value) > 63 or not LABEL_VALUE.match(value):
                out.append(f"{where}: Invalid value: {value!r}: a valid label must be 63 characters or less")
    template_labels = labelled[2][1]
    if any(template_labels.get(k) != v for k, v in labelled[1][1].items()):
        out.append("spec.template.metadata.labels: Invalid value: `selector` does not match template `labels`")
    return out


def review(spec: dict) -> dict:
    """A TokenReview's status: who a token is, if it was issued for (one of) the audiences asked about."""
    bound = TOKENS.get(spec.get("token", ""))
    if bound is None:
        return {"authenticated": False, "error": "[invalid bearer token, square/go-jose: error in cryptographic "
                                                 "primitive]", "user": {}}
    wanted = spec.get("audiences") or ["https://kubernetes.default.svc"]
    met = [a for a in bound["audiences"] if a in wanted]
    if not met:
        return {"authenticated": False, "error": "[invalid bearer token, token audiences "
                                                 f"{bound['audiences']} is invalid for the target audiences {wanted}]",
                "user": {}}
    namespace = bound["username"].split(":")[2]
    return {"authenticated": True, "audiences": met, "user": {
        "username": bound["username"], "uid": "0b4f-uid", "groups": ["system:serviceaccounts",
                                                                    f"system:serviceaccounts:{namespace}",
                                                                    "system:authenticated"],
        "extra": {"authentication.kubernetes.io/pod-name": [bound["pod"]],
                  "authentication.kubernetes.io/pod-uid": ["5e2c-pod-uid"]}}}


def status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason,
            "code": code}


class Handler(BaseHTTPRequestHandler):
    token = ""
    log_path = ""
    sent: dict | None = None

    def _send(self, code: int, body: dict) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"method": self.command, "path": urlsplit(self.path).path, "query":
                                parse_qs(urlsplit(self.path).query), "sent": self.sent, "code": code}) + "\n")
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _handle(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        url = urlsplit(self.path)
        self.sent = body
        scheme, _, given = (self.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or given != self.token:  # the auth scheme is case-insensitive
            return self._send(401, status(401, "Unauthorized", "Unauthorized"))
        parts = url.path.strip("/").split("/")
        if parts == ["apis", "authentication.k8s.io", "v1", "tokenreviews"] and self.command == "POST":
            return self._send(201, dict(body, status=review(body.get("spec", {}))))
        if parts[:2] == ["api", "v1"] and parts[-1] == "pods":
            selector = parse_qs(url.query).get("labelSelector", [""])[0]
            return self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {},
                                    "items": [p for p in list(PODS.values()) if selected(p, selector)]})
        if parts[:3] != ["apis", "apps", "v1"] or "deployments" not in parts:
            return self._send(404, status(404, "NotFound", "the server could not find the requested resource"))
        rest = parts[parts.index("deployments") + 1:]
        if not rest:
            return self._send(200, {"kind": "DeploymentList", "apiVersion": "apps/v1", "metadata": {},
                                    "items": list(DEPLOYMENTS.values())})
        name, sub = rest[0], (rest[1] if len(rest) > 1 else "")
        dep = DEPLOYMENTS.get(name)
        if self.command == "PATCH" and not sub and "apply-patch" in self.headers.get("content-type", ""):
            if body["metadata"].get("annotations", {}).get("fleet.ai/model") in FAIL_MODELS:
                return self._send(500, status(500, "InternalError", "etcdserver: request timed out"))
            problems = invalid(body)
            if problems:
                return self._send(422, status(422, "Invalid", f'Deployment.apps "{name}" is invalid: '
                                              + "; ".join(problems)))
            created = dep is None
            DEPLOYMENTS[name] = dict(body, status={"replicas": 0})
            return self._send(201 if created else 200, DEPLOYMENTS[name])
        if dep is None:
            return self._send(404, status(404, "NotFound", f'deployments.apps "{name}" not found'))
        if sub == "scale":
            if self.command == "PATCH":
                dep["spec"]["replicas"] = body["spec"]["replicas"]
            return self._send(200, {"kind": "Scale", "apiVersion": "autoscaling/v1",
                                    "metadata": {"name": name, "namespace": dep["metadata"]["namespace"]},
                                    "spec": {"replicas": dep["spec"].get("replicas", 1)}, "status": {"replicas": 0}})
        return self._send(200, dep)

    do_GET = do_PATCH = do_POST = do_PUT = _handle

    def log_message(self, *args) -> None:
        pass


def server(port: int, cert: str, key: str, token: str, log: str) -> ThreadingHTTPServer:
    """The stand-in on 127.0.0.1:`port` (0: any free port), TLS with `cert`, `token` required; not yet serving."""
    Handler.token, Handler.log_path = token, log
    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    return httpd


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--cert", "--key", "--token", "--log"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--port", type=int, default=6443)
    args = ap.parse_args()
    server(args.port, args.cert, args.key, open(args.token).read().strip(), args.log).serve_forever()


if __name__ == "__main__":
    main()
