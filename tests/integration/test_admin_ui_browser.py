"""The admin UI end to end: `fleet up` (the whole platform, UI included), real requests from two teams,
then headless Chromium signs in and renders every page; no Streamlit exception and no error box may show.
The screenshots go to docs/img/admin-<page>.png (docs/admin_ui.md shows them)."""
from __future__ import annotations

import time

import httpx
import pytest

from common.settings import REPO_ROOT
from registry import queries
from registry.db import session_scope
from tests.admin_ui.browser import capture_admin_ui
from tests.integration.platform import Platform

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"
SHOTS = REPO_ROOT / "docs" / "img"
PROMPTS = ["What is the capital of France?", "Name three primary colours.", "Say hello in Spanish.",
           "What is 2 + 2?"]


def _second_team_key(p: Platform) -> str:
    """A caller of another team, added to the platform's registry (the router reloads it within a second)."""
    with session_scope(p.env.get("FLEET_DB_URL", f"sqlite:///{p.data_dir / 'registry.sqlite'}")) as s:
        return queries.create_caller(s, "search-svc", "search")


def _complete(p: Platform, key: str, prompt: str, stream: bool) -> None:
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": prompt}]}
    headers = {"authorization": f"Bearer {key}"}
    if stream:
        with httpx.stream("POST", f"{p.http_url}/v1/chat/completions", json=body, headers=headers,
                          timeout=120) as resp:
            assert resp.status_code == 200
            assert "[DONE]" in "".join(resp.iter_text())
    else:
        resp = httpx.post(f"{p.http_url}/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert resp.status_code == 200, resp.text


def _usage_rows(p: Platform) -> int:
    from usage.store import connect
    with connect(p.data_dir / "usage.duckdb", read_only=True) as con:
        return con.execute("SELECT count(*) FROM usage_events").fetchone()[0]


def test_every_admin_page_renders_with_real_data(platform):
    """Uses the session's shared platform (tests/integration/conftest.py)."""
    p = platform
    rows_before = _usage_rows(p)
    search_key = _second_team_key(p)
    time.sleep(1.5)
    sent = 0
    for i, prompt in enumerate(PROMPTS):
        for key in (p.api_key, search_key):
            _complete(p, key, prompt, stream=bool(i % 2))
            sent += 1
    # an operator change, so the audit log shows one made through the admin API
    resp = httpx.post(f"{p.http_url}/admin/models/{MODEL}/rollout", json={"version": "1", "percent": 100},
                      headers={"authorization": f"Bearer {p.admin_token}"}, timeout=30)
    assert resp.status_code == 200, resp.text
    deadline = time.monotonic() + 90
    while _usage_rows(p) < rows_before + sent and time.monotonic() < deadline:
        time.sleep(1)
    assert _usage_rows(p) >= rows_before + sent, "usage events did not reach the store"

    ui = f"http://127.0.0.1:{p.env['FLEET_ADMIN_UI_PORT']}"
    viewer_token = (p.data_dir / "viewer-token").read_text().strip()
    reports = capture_admin_ui(ui, p.admin_token, SHOTS, simulate=True, timeout_s=180, viewer_token=viewer_token)
    assert [r.name for r in reports] == ["login", "fleet", "rollouts", "buffers", "chargeback", "capacity",
                                         "rollouts-viewer"]
    for r in reports:
        assert not r.exceptions, f"{r.name}: Streamlit exception {r.exceptions}"
        assert not r.errors, f"{r.name}: error shown {r.errors}"
        assert r.screenshot.stat().st_size > 20_000, f"{r.name}: screenshot looks empty"
    assert reports[-1].write_controls == 0, "a viewer must see no write controls"
