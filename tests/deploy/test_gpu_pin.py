"""GPU product pin from the engine's build info: `build-engines --target trtllm` records the build GPU
(common/gpu_info.py, from `nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader`; the fixture is that
command's answer on a 4 x H100 SXM node, in its documented format: no GPU here), the registry keeps it in the
version's build_info, and the Kubernetes actuator pins the pool's pods to that product's nodes, replacing whatever
product the overlay's template names."""
from __future__ import annotations

from pathlib import Path

import pytest

from autoscale.actuators import PoolSpec
from autoscale.actuators.kubernetes import KubernetesActuator, deployment_manifest
from common.gpu_info import PRODUCT_LABEL, parse_query, product_label
from registry import queries
from registry.db import migrate, session_scope
from tests.deploy.test_manifests import render

SMI = Path(__file__).parent / "fixtures" / "nvidia-smi-h100x4.csv"


def _overlay_pool(name: str) -> dict:
    return next(o for o in render("gpu-prod") if o["kind"] == "Deployment" and o["metadata"]["name"] == name)


def test_build_info_names_the_gpu_and_the_overlay_pin_is_that_product() -> None:
    gpu = parse_query(SMI.read_text())
    assert gpu == {"product": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "count": 4,
                   "product_label": "NVIDIA-H100-80GB-HBM3"}
    for name in ("llm-pool-llama-70b-1", "llm-pool-llama-8b-1"):
        selector = _overlay_pool(name)["spec"]["template"]["spec"]["nodeSelector"]
        assert selector[PRODUCT_LABEL] == gpu["product_label"], name  # the overlay's first rollout agrees


def test_the_actuator_pins_pods_to_the_gpu_the_version_was_built_on(tmp_path) -> None:
    overlay = _overlay_pool("llm-pool-llama-70b-1")
    db_url = f"sqlite:///{tmp_path / 'registry.sqlite'}"
    migrate(db_url)
    h200 = parse_query("NVIDIA H200, 9.0\n" * 4)  # version 2 was built on H200s: its engine runs only there
    with session_scope(db_url) as s:
        queries.upsert_model_version(s, "llama-70b", "2", status="staged", build_info={"gpu": h200})
    actuator = KubernetesActuator.__new__(KubernetesActuator)  # no API client needed to read the registry
    actuator.db_url = db_url
    spec = PoolSpec("llama-70b", "2", "region-a", 4)
    info = actuator._build_info(spec)
    pod = deployment_manifest(spec, "llm", template=overlay, build_info=info)["spec"]["template"]["spec"]
    assert pod["nodeSelector"][PRODUCT_LABEL] == "NVIDIA-H200"
    assert actuator._build_info(PoolSpec("llama-70b", "9", "region-a", 4)) is None  # not registered: no pin
    cpu = deployment_manifest(PoolSpec("smollm2", "1", "r", 1), "llm", build_info={"tool": "build-engines cpu"})
    assert PRODUCT_LABEL not in (cpu["spec"]["template"]["spec"].get("nodeSelector") or {})


@pytest.mark.parametrize("output, why", [("", "expected"), ("NVIDIA H100 80GB HBM3, 9.0\nNVIDIA A100-SXM4-80GB, 8.0\n",
                                                            "mixed GPUs")])
def test_unusable_nvidia_smi_answers_are_refused(output, why) -> None:
    with pytest.raises(ValueError, match=why):
        parse_query(output)


def test_product_labels_are_valid_label_values() -> None:
    assert product_label("Tesla V100-SXM2-16GB") == "Tesla-V100-SXM2-16GB"
    assert product_label("NVIDIA GeForce RTX 4090 (D)") == "NVIDIA-GeForce-RTX-4090-D"
    assert len(product_label("X " * 60)) <= 63
