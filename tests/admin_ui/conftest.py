"""Fixtures for the admin UI's AppTest tests: a real registry, router HTTP app and usage store per test."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from common.settings import REPO_ROOT
from tests.admin_ui.stack import OPERATOR_TOKEN, VIEWER_TOKEN, Stack, start_stack

PAGES = REPO_ROOT / "admin_ui" / "pages"


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    s = start_stack(tmp_path / "fleet")
    for key, value in s.env.items():
        monkeypatch.setenv(key, value)
    for key in ("FLEET_ADMIN_TOKEN", "FLEET_VIEWER_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    yield s
    s.stop()


@pytest.fixture
def page(stack: Stack) -> Callable[..., AppTest]:
    """page("rollouts", role="operator") -> an AppTest of that page, signed in, already run once."""
    def open_page(name: str, role: str | None = "operator", timeout: float = 60) -> AppTest:
        at = AppTest.from_file(str(PAGES / f"{name}.py"), default_timeout=timeout)
        if role is not None:
            at.session_state["token"] = OPERATOR_TOKEN if role == "operator" else VIEWER_TOKEN
            at.session_state["role"] = role
        return at.run()
    return open_page
