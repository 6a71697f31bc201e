"""Names the Kubernetes API server accepts, made from model names and versions that it would refuse.

Model names like `meta-llama/Llama-3.1-70B` and versions like `v2+lora` are not valid object names
(RFC 1123 DNS labels: lowercase alphanumerics and '-', at most 63 characters) nor label values (at most 63
characters of [A-Za-z0-9._-], starting and ending alphanumeric). Each function maps any string to a valid
one; when it had to change or shorten the input it appends a short hash of the original, so two different
inputs never share a name (`Llama.3` and `llama-3` stay apart). The exact model and version travel in
annotations (`fleet.ai/model`, `fleet.ai/version`), which have no such limits.
"""
from __future__ import annotations

import hashlib
import re

MAX_LABEL = 63
_HASH_LEN = 8


def _digest(original: str) -> str:
    return hashlib.sha256(original.encode()).hexdigest()[:_HASH_LEN]


def _fit(cleaned: str, original: str, limit: int, changed: bool) -> str:
    if not changed and len(cleaned) <= limit:
        return cleaned
    head = cleaned[: limit - _HASH_LEN - 1].rstrip("-._")
    return f"{head}-{_digest(original)}" if head else _digest(original)


def dns_label(name: str, limit: int = MAX_LABEL) -> str:
    """An RFC 1123 label (object names such as a Deployment's; Service names, label-name parts)."""
    cleaned = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", name.lower())).strip("-")
    return _fit(cleaned, name, limit, cleaned != name)


def label_value(value: str) -> str:
    """A label value: up to 63 characters of [A-Za-z0-9._-], alphanumeric at both ends (or empty)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", value).strip("-._")
    return _fit(cleaned, value, MAX_LABEL, cleaned != value)


def pool_label(model: str, version: str) -> str:
    """The `fleet.ai/pool` label value of a model version's pool: what the overlays' pools carry and what the
    actuator and the registrar select on (e.g. `llama-70b-1`)."""
    return dns_label(f"{model}-{version}")


def deployment_name(model: str, version: str) -> str:
    """The pool's Deployment: `llm-pool-<pool label>` (the overlays' nameSuffix), shortened to 63."""
    return dns_label(f"llm-pool-{pool_label(model, version)}")
