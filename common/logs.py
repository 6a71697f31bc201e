"""Logging setup shared by every service: one line per event, timestamped, with the component name."""
from __future__ import annotations

import logging
import os


def setup_logging(component: str) -> logging.Logger:
    level = os.environ.get("FLEET_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s {component} %(name)s: %(message)s",
    )
    for noisy in ("alembic", "kafka", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(component)
