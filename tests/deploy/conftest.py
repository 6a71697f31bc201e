"""Fixtures of the tests that run manifests' containers as local processes (tests/deploy/pod_harness.py)."""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy import pod_harness


@pytest.fixture
def pod_scratch(request) -> Iterator[Path]:
    """A scratch folder for one test's pods, removed after it: outside /tmp (the containers get their own tmpfs
    /tmp, which would hide pytest's tmp_path) and world-readable (pod_harness.work_dir)."""
    path = pod_harness.work_dir(f"fleet-{request.node.name[:40]}-")
    yield path
    shutil.rmtree(path, ignore_errors=True)
