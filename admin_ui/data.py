"""Data access for the admin UI pages (the pages themselves only lay out what these return)."""
from __future__ import annotations

import pandas as pd

from fleet.settings import load_settings
from registry import queries
from registry.db import session_scope


def models_frame(db_url: str | None = None) -> pd.DataFrame:
    """One row per model version: status, context length and its share of traffic."""
    with session_scope(db_url or load_settings().db_url) as s:
        rows = [{"model": m.name, "version": m.version, "status": m.status, "max_context": m.max_context,
                 "route_percent": m.percent} for m in queries.model_summaries(s)]
    return pd.DataFrame(rows, columns=["model", "version", "status", "max_context", "route_percent"])
