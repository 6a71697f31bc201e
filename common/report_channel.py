"""The authenticated channel replicas use to push state reports to routers' internal listeners.

Each replica signs its reports with its own key, derived from the fleet's report secret and its replica id
(`replica_key`): a replica can only speak for itself, and a leaked replica key does not let anyone forge
other replicas' reports. A signature covers a timestamp and the exact body bytes, so a captured report
cannot be altered and is refused once older than `MAX_SKEW_S`. A second signature, in the same header,
covers the timestamp, the replica id and the body's length (`n=`, `h1=`): the router checks it from the
headers alone (`verify_report_head`) and then reads at most that many bytes, so a peer without the key
makes the router read no body at all.

Senders (the engine's `StateReporter`, a GPU state reporter) call `post_report`; the router calls
`verify_report`. The secret is FLEET_REPORT_SECRET or `<data dir>/report-secret` (created on first use, mode
0600); a replica gets only its derived key in `FLEET_REPORT_KEY`, or, in Kubernetes, trades its pod-bound token
for it at a router (common/report_key_exchange.py).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
import urllib.request
from typing import Any

from common.settings import Settings

REPORT_PATH = "/internal/replica-state"
SIGNATURE_HEADER = "x-fleet-report-signature"
REPLICA_HEADER = "x-fleet-replica-id"
MAX_SKEW_S = 30.0


class ReportAuthError(ValueError):
    """A report whose signature is missing, malformed, stale or wrong."""


def load_report_secret(settings: Settings) -> bytes:
    """The fleet's report secret: FLEET_REPORT_SECRET, else the data dir's file (created if missing)."""
    if settings.report_secret:
        return settings.report_secret.encode()
    path = settings.report_secret_file
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process created it first
            return path.read_text().strip().encode()
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return path.read_text().strip().encode()


def replica_key(secret: bytes, replica_id: str) -> str:
    """The key one replica signs with (hex); given to that replica alone."""
    return hmac.new(secret, b"replica-report:" + replica_id.encode(), hashlib.sha256).hexdigest()


def sign(key: str, body: bytes, ts: int | None = None) -> str:
    ts = int(time.time()) if ts is None else ts
    mac = hmac.new(key.encode(), str(ts).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={ts},v1={mac}"


def _head_mac(key: str, replica_id: str, ts: int, length: int) -> str:
    return hmac.new(key.encode(), f"head.{ts}.{replica_id}.{length}".encode(), hashlib.sha256).hexdigest()


def sign_head(key: str, replica_id: str, body: bytes, ts: int | None = None) -> str:
    """The full signature header: the body's signature plus the head's (length and replica, from headers)."""
    ts = int(time.time()) if ts is None else ts
    return f"{sign(key, body, ts)},n={len(body)},h1={_head_mac(key, replica_id, ts, len(body))}"


def _parts(header: str | None) -> dict[str, str]:
    if not header:
        raise ReportAuthError(f"{SIGNATURE_HEADER}: missing; reports must be signed with the replica's key")
    try:
        parts = dict(p.split("=", 1) for p in header.split(","))
        int(parts["t"]), parts["v1"]
    except (KeyError, ValueError) as exc:
        raise ReportAuthError(f"{SIGNATURE_HEADER}: malformed; expected 't=<unix seconds>,v1=<hex hmac>,"
                              f"n=<body bytes>,h1=<hex hmac>'") from exc
    return parts


def verify_report_head(secret: bytes, replica_id: str, header: str | None) -> int:
    """From the headers alone: the body length `replica_id` signed for, fresh; ReportAuthError otherwise."""
    parts = _parts(header)
    ts = int(parts["t"])
    if "n" not in parts or "h1" not in parts or not parts["n"].isdigit():
        raise ReportAuthError(f"{SIGNATURE_HEADER}: no signed body length (n=, h1=); refused before reading the body")
    if abs(time.time() - ts) > MAX_SKEW_S:
        raise ReportAuthError(f"{SIGNATURE_HEADER}: timestamp {ts} is more than {MAX_SKEW_S:g} s from now")
    length = int(parts["n"])
    if not hmac.compare_digest(_head_mac(replica_key(secret, replica_id), replica_id, ts, length), parts["h1"]):
        raise ReportAuthError(f"{SIGNATURE_HEADER}: head signature does not match replica {replica_id!r}")
    return length


def verify_report(secret: bytes, replica_id: str, body: bytes, header: str | None) -> None:
    """Raise ReportAuthError unless `header` is a fresh signature of `body` by `replica_id`'s key."""
    parts = _parts(header)
    ts, mac = int(parts["t"]), parts["v1"]
    if abs(time.time() - ts) > MAX_SKEW_S:
        raise ReportAuthError(f"{SIGNATURE_HEADER}: timestamp {ts} is more than {MAX_SKEW_S:g} s from now")
    expected = sign(replica_key(secret, replica_id), body, ts).split("v1=", 1)[1]
    if not hmac.compare_digest(expected, mac):
        raise ReportAuthError(f"{SIGNATURE_HEADER}: signature does not match replica {replica_id!r}")


def post_report(router_url: str, report: dict[str, Any], key: str, timeout_s: float = 0.5) -> None:
    """Sign and POST one report to a router's internal listener (raises on any failure)."""
    body = json.dumps(report).encode()
    replica_id = str(report.get("replica_id", ""))
    headers = {"content-type": "application/json", SIGNATURE_HEADER: sign_head(key, replica_id, body),
               REPLICA_HEADER: replica_id}
    req = urllib.request.Request(router_url.rstrip("/") + REPORT_PATH, data=body, method="POST", headers=headers)
    urllib.request.urlopen(req, timeout=timeout_s).close()
