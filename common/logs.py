"""Logging setup shared by every service: one line per event, timestamped, with the component name."""
from __future__ import annotations

import logging


def setup_logging(component: str, level: str = "INFO") -> logging.Logger:
    """Configure the root logger once, at start; `level` comes from Settings.log_level (FLEET_LOG_LEVEL)."""
    level = level.upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s {component} %(name)s: %(message)s",
    )
    for noisy in ("alembic", "kafka", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(component)
