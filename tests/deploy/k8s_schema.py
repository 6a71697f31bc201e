"""Check rendered Kubernetes objects against the official `kubernetes` client's models: every field must be
one the model declares (the client itself ignores unknown keys, so a typo would pass silently), and every
object must deserialise into its model."""
from __future__ import annotations

import json
import re
from typing import Any

from kubernetes import client

_LIST = re.compile(r"^(?:list|List)\[(.+)\]$")
_DICT = re.compile(r"^(?:dict\((\w+), (.+)\)|Dict\[(\w+), (.+)\])$")
PRIMITIVES = {"str", "int", "float", "bool", "object", "datetime", "date", "bytes", "bytearray"}


def model_for(obj: dict[str, Any]) -> str:
    """V1Deployment for apps/v1 Deployment, etc. (this project only uses v1 groups)."""
    version = obj["apiVersion"].split("/")[-1]
    return f"{version.capitalize()}{obj['kind']}"


def unknown_fields(value: Any, type_name: str, path: str = "") -> list[str]:
    """Paths of keys the model type does not declare (recursively)."""
    if type_name in PRIMITIVES:
        return []
    m = _LIST.match(type_name)
    if m:
        return [p for i, item in enumerate(value or []) for p in unknown_fields(item, m.group(1), f"{path}[{i}]")]
    m = _DICT.match(type_name)
    if m:
        inner = m.group(2) or m.group(4)
        return [p for k, v in (value or {}).items() for p in unknown_fields(v, inner, f"{path}.{k}")]
    cls = getattr(client, type_name)
    if not isinstance(value, dict):
        return [f"{path}: expected an object for {type_name}, got {type(value).__name__}"]
    by_json = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    problems = []
    for key, item in value.items():
        attr = by_json.get(key)
        if attr is None:
            problems.append(f"{path}.{key} (not a field of {type_name})")
        else:
            problems += unknown_fields(item, cls.openapi_types[attr], f"{path}.{key}")
    return problems


def deserialize(obj: dict[str, Any]) -> Any:
    """The object as its client model (raises on a missing required field or a wrong type)."""
    return client.ApiClient().deserialize(json.dumps(obj), model_for(obj), "application/json")
