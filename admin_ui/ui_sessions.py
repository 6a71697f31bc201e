"""Sign-ins that survive a browser reload, without putting a token in the URL.

On sign-in the UI server keeps (token, role) under a random 256-bit session id, in memory, for
`SESSION_TTL_S`; the browser gets only that id, as a SameSite=Strict cookie set by a tiny script. On a
reload (a new Streamlit session) the cookie comes back in `st.context.cookies` and the id is looked up.
The id is worthless without this server process: restarting the admin UI signs everyone out, signing out
forgets the id, and ids expire. URLs carry only the page and its filters, so they can be shared safely.
"""
from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass

COOKIE = "fleet_ui_session"
SESSION_TTL_S = 8 * 3600
MAX_SESSIONS = 10_000  # bounded memory: the oldest sessions are dropped first


@dataclass
class UiSession:
    token: str
    role: str
    expires: float


class SessionStore:
    """Thread-safe id -> UiSession map (one per UI server process)."""

    def __init__(self, ttl_s: float = SESSION_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._sessions: dict[str, UiSession] = {}
        self._lock = threading.Lock()

    def create(self, token: str, role: str, now: float | None = None) -> str:
        now = now if now is not None else time.time()
        sid = secrets.token_urlsafe(32)
        with self._lock:
            self._sessions = {k: v for k, v in self._sessions.items() if v.expires > now}
            while len(self._sessions) >= MAX_SESSIONS:
                self._sessions.pop(next(iter(self._sessions)))
            self._sessions[sid] = UiSession(token, role, now + self.ttl_s)
        return sid

    def get(self, sid: str | None, now: float | None = None) -> UiSession | None:
        if not sid:
            return None
        now = now if now is not None else time.time()
        with self._lock:
            found = self._sessions.get(sid)
            if found is not None and found.expires <= now:
                self._sessions.pop(sid, None)
                return None
            return found

    def drop(self, sid: str | None) -> None:
        with self._lock:
            self._sessions.pop(sid or "", None)


def cookie_script(sid: str | None, max_age_s: int = SESSION_TTL_S) -> str:
    """A <script> that sets (sid) or clears (None) the session cookie of this origin."""
    value = json.dumps(f"{COOKIE}={sid or ''}; path=/; max-age={max_age_s if sid else 0}; SameSite=Strict")
    return f"<script>document.cookie = {value};</script>"
