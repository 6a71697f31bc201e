"""Sign-ins that survive a reload: random ids, expiry, sign-out, bounded memory, and a cookie without the token."""
from __future__ import annotations

from admin_ui import ui_sessions
from admin_ui.ui_sessions import SessionStore


def test_a_session_id_finds_the_token_until_it_expires_or_is_dropped():
    store = SessionStore(ttl_s=60)
    sid = store.create("fa-secret", "operator", now=1000.0)
    assert len(sid) >= 40 and "fa-secret" not in sid
    found = store.get(sid, now=1059.0)
    assert (found.token, found.role) == ("fa-secret", "operator")
    assert store.get(sid, now=1061.0) is None, "expired"
    other = store.create("fv-x", "viewer", now=2000.0)
    store.drop(other)
    assert store.get(other, now=2001.0) is None, "signed out"
    assert store.get("made-up", now=2001.0) is None and store.get(None) is None


def test_ids_are_unique_and_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(ui_sessions, "MAX_SESSIONS", 3)
    store = SessionStore(ttl_s=60)
    ids = [store.create(f"t{i}", "viewer", now=1000.0 + i) for i in range(5)]
    assert len(set(ids)) == 5
    assert [store.get(i, now=1010.0) is not None for i in ids] == [False, False, True, True, True]


def test_the_cookie_carries_only_the_id_and_sign_out_clears_it():
    script = ui_sessions.cookie_script("abc123")
    assert "fleet_ui_session=abc123" in script and "SameSite=Strict" in script and "max-age=28800" in script
    assert "max-age=0" in ui_sessions.cookie_script(None)
