"""Which GPU an engine was built on, recorded in the version's build info and used to place its replicas.

TensorRT engines (fp8 TensorRT-LLM ones included) run only on the GPU model they were built for (TensorRT's
default, no hardware-compatibility mode), so `build-engines --target trtllm` records the build GPU's product
name and compute capability (`nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader`) as
`build_info["gpu"]`, and the Kubernetes actuator pins the pool's pods to nodes whose GPU feature discovery
label `nvidia.com/gpu.product` is that product (`product_label`; GFD writes the name with spaces as dashes).
"""
from __future__ import annotations

import re
import subprocess
from typing import Any

PRODUCT_LABEL = "nvidia.com/gpu.product"
QUERY = ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"]


def parse_query(output: str) -> dict[str, Any]:
    """Build info from nvidia-smi's CSV answer (one line per GPU); every GPU of a build must be the same model."""
    rows = [tuple(part.strip() for part in line.split(",")) for line in output.splitlines() if line.strip()]
    if not rows or any(len(r) != 2 for r in rows):
        raise ValueError(f"nvidia-smi: expected 'name, compute_cap' lines, got {output[:200]!r}")
    if len(set(rows)) != 1:
        raise ValueError(f"nvidia-smi: mixed GPUs {sorted(set(rows))}; an engine is built for one GPU model")
    name, capability = rows[0]
    return {"product": name, "compute_capability": capability, "count": len(rows),
            "product_label": product_label(name)}


def query_gpus(timeout_s: float = 20.0) -> dict[str, Any]:
    """This machine's GPUs, as `parse_query` records them (raises where nvidia-smi cannot run)."""
    return parse_query(subprocess.run(QUERY, capture_output=True, text=True, timeout=timeout_s, check=True).stdout)


def product_label(name: str) -> str:
    """GPU feature discovery's value of `nvidia.com/gpu.product` for a product name (a valid label value)."""
    value = re.sub(r"[^A-Za-z0-9_.-]", "", re.sub(r"\s+", "-", name.strip()))[:63]
    return value.strip("-_.")


def node_selector(build_info: dict[str, Any] | None) -> dict[str, str]:
    """The node selector a version's pods need: its build GPU's product; {} for engines not built for a GPU."""
    gpu = (build_info or {}).get("gpu") or {}
    return {PRODUCT_LABEL: gpu["product_label"]} if gpu.get("product_label") else {}
