"""Patterns for names that cross trust boundaries (adapter names, caller correlation ids).

One definition shared by the router (which refuses bad names with a 400) and the engine (which refuses them
again, so a replica reached directly can never be steered to a path outside its adapters folder).
"""
from __future__ import annotations

import re

# A folder name under the replica's adapters dir: no '/', no leading '.', so never a path.
ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
ADAPTER_NAME_RULE = "1-128 characters of A-Z a-z 0-9 _ . - starting with a letter or digit (a name, never a path)"
# The caller's own request id: echoed back for correlation, never used for billing or de-duplication.
CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9_.:/=+-]{1,128}$")
CLIENT_ID_RULE = "1-128 characters of A-Z a-z 0-9 _ . : / = + -"


def valid_adapter_name(name: str) -> bool:
    return bool(ADAPTER_NAME_RE.match(name)) and ".." not in name
