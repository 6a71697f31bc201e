"""One model class per architecture family, composed from the shared layers (layers.py) on Llama's decoder
(llama.py); `support.py` is the allow-list that build-engines and the engine both check.

`model_for(cfg)` returns the family's model for a config.json, or raises support.UnsupportedModel naming the
field. This package's __init__ imports no torch, so build-engines reads the allow-list cheaply.
"""
from __future__ import annotations

import importlib
from typing import Any

from python_backends.engine.models.support import ARCHITECTURES, check_config


def model_for(cfg: dict[str, Any]) -> Any:
    module, cls = ARCHITECTURES[check_config(cfg)]
    return getattr(importlib.import_module(f"python_backends.engine.models.{module}"), cls)(cfg)
