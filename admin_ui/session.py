"""Login state and small shared Streamlit helpers used by every page.

The token and its role live in `st.session_state` (`token`, `role`). The role is asked from the router
(`GET /admin/whoami`); when the router is down the data dir's token files decide, so a read-only view
still works. Writes are only offered to operators, and the router refuses a viewer's writes anyway.
A sign-in survives a browser reload through a session cookie (admin_ui/ui_sessions.py).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import streamlit as st

from admin_ui import ui_sessions
from admin_ui.router_client import AdminApiError, RouterClient, RouterDown
from common.settings import Settings, load_settings

ROLES = ("operator", "viewer")


def settings() -> Settings:
    return load_settings()


def login(token: str) -> tuple[str | None, str]:
    """Check a token; on success store it in the session. Returns (role or None, message)."""
    token = token.strip()
    if not token:
        return None, "enter an admin (operator) or viewer token"
    s = settings()
    try:
        role = RouterClient(s.router_http_url, token).whoami()
        note = ""
    except AdminApiError as exc:
        return None, f"the router refused this token: {exc.message}"
    except RouterDown as exc:
        role = s.admin_tokens().get(token)  # the router is down: the env / data dir's token files decide
        if role is None:
            return None, f"{exc}; the token does not match the data dir's token files either"
        note = (f"The router is down ({s.router_http_url}); signed in from the data dir's token files; "
                "only what the registry and the usage store hold can be shown.")
    st.session_state["token"], st.session_state["role"] = token, role
    st.session_state["ui_sid"] = _sessions().create(token, role)
    st.session_state["cookie_script"] = ui_sessions.cookie_script(st.session_state["ui_sid"])
    return role, note


@st.cache_resource
def _sessions() -> ui_sessions.SessionStore:
    """The sign-ins of this UI server process (shared by every browser session)."""
    return ui_sessions.SessionStore()


def restore() -> None:
    """After a browser reload: sign the new Streamlit session in again from the session cookie."""
    if role() in ROLES:
        return
    sid = st.context.cookies.get(ui_sessions.COOKIE) if st.context.cookies else None
    if sid and sid != st.session_state.get("signed_out_sid"):
        found = _sessions().get(sid)
        if found is not None:
            st.session_state.update(token=found.token, role=found.role, ui_sid=sid)


def pending_cookie_script() -> str | None:
    """The cookie-setting (or clearing) script still to send to the browser, once."""
    return st.session_state.pop("cookie_script", None)


def logout() -> None:
    sid = st.session_state.pop("ui_sid", None)
    _sessions().drop(sid)
    st.session_state["signed_out_sid"] = sid  # the browser may still send the cookie until the script runs
    st.session_state["cookie_script"] = ui_sessions.cookie_script(None)
    for key in ("token", "role"):
        st.session_state.pop(key, None)


def role() -> str | None:
    return st.session_state.get("role")


def is_operator() -> bool:
    return role() == "operator"


def require_login() -> str:
    """The signed-in role; stops the page with a hint when nobody is signed in."""
    current = role()
    if current not in ROLES:
        st.warning("Sign in first: open the **Login** page and enter an admin or viewer token.")
        st.stop()
    return current


def client() -> RouterClient:
    return RouterClient(settings().router_http_url, st.session_state.get("token", ""))


def header(title: str, caption: str) -> None:
    st.title(title)
    st.caption(f"{caption} · signed in as **{role()}** · amounts in {settings().currency}")
    show_flash()


def currency() -> str:
    """The one currency of every amount in the UI (FLEET_CURRENCY, default USD)."""
    return settings().currency


def safe(what: str, fn: Callable[..., Any], *args, **kwargs) -> Any | None:
    """Run a read; on failure show what could not be read and return None so the page goes on."""
    try:
        return fn(*args, **kwargs)
    except RouterDown as exc:
        st.error(f"Router down: {what} is not available. {exc}")
    except AdminApiError as exc:
        st.error(f"The router refused to give {what}: {exc.message}")
    except Exception as exc:  # registry or usage store down: say so and keep the rest of the page
        st.error(f"{what} cannot be read: {type(exc).__name__}: {exc}")
    return None


def write(action: Callable[[], Any], done: str, where: Any = None) -> bool:
    """Run an admin-API write and show the outcome in `where` (the container next to the control)."""
    box = where if where is not None else st
    try:
        result = action()
    except AdminApiError as exc:
        box.error(f"Not changed ({exc.status}): {exc.message}")
        return False
    except RouterDown as exc:
        box.error(f"Not changed: {exc}")
        return False
    st.session_state["flash"] = f"{done}: {result}" if result is not None else done
    st.rerun()
    return True  # not reached: the rerun shows the new state and the flash message


def show_flash() -> None:
    """Show (once) the result of the last successful write, which reran the page."""
    message = st.session_state.pop("flash", None)
    if message:
        st.success(message)
