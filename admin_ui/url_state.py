"""Page filters kept in the URL (`?team=search&range=6h`), so a view can be bookmarked and shared.

A page reads each filter's starting value with `initial(...)` (an unknown or malformed value in the URL
falls back to the default and is dropped) and writes the chosen values back with `publish(...)`.
"""
from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import streamlit as st


def initial(key: str, default: str, allowed: Sequence[str] | None = None) -> str:
    """The URL's value of `key` when it is one of `allowed` (or any when None), else `default`."""
    value = st.query_params.get(key)
    if value is None or (allowed is not None and value not in allowed):
        return default
    return value


def initial_date(key: str, default: dt.date) -> dt.date:
    try:
        return dt.date.fromisoformat(st.query_params.get(key, ""))
    except ValueError:
        return default


def publish(**values: object) -> None:
    """Put the current filter values in the URL; None or '' removes a key."""
    for key, value in values.items():
        text = "" if value is None else str(value)
        if text:
            if st.query_params.get(key) != text:
                st.query_params[key] = text
        elif key in st.query_params:
            del st.query_params[key]
