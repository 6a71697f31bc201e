"""First-run registry contents for a local platform: the SmolLM2 route, a dev team and caller, admin
(operator) and viewer tokens."""
from __future__ import annotations

import secrets

from fleet.settings import Settings
from registry import queries
from registry.db import session_scope
from registry.schema import WarmBuffer

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_VERSION = "1"


def seed(settings: Settings) -> tuple[str, str]:
    """Idempotent: returns (dev API key, admin token), creating them only when missing."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    with session_scope(settings.db_url) as s:
        built = queries.get_model_version(s, DEFAULT_MODEL, DEFAULT_VERSION) is not None
        if built and not queries.routes_for(s, DEFAULT_MODEL):
            queries.set_routes(s, DEFAULT_MODEL, {DEFAULT_VERSION: 100}, actor="fleet-seed")
            queries.set_model_status(s, DEFAULT_MODEL, DEFAULT_VERSION, "serving")
        existing = settings.dev_api_key_file.read_text().strip() if settings.dev_api_key_file.exists() else ""
        if not existing or queries.caller_by_key(s, existing) is None:
            existing = queries.create_caller(s, "dev", "dev-team", api_key=existing or None)
            settings.dev_api_key_file.write_text(existing + "\n")
            settings.dev_api_key_file.chmod(0o600)
        if not s.query(WarmBuffer).filter_by(model=DEFAULT_MODEL, version=DEFAULT_VERSION).first():
            s.add(WarmBuffer(model=DEFAULT_MODEL, version=DEFAULT_VERSION, min_idle_replicas=0, min_replicas=1,
                             max_replicas=2, slo_ttft_ms_p95=500, slo_tokens_per_s=40))
    for path, prefix in ((settings.admin_token_file, "fa-"), (settings.viewer_token_file, "fv-")):
        if not path.exists():
            path.write_text(prefix + secrets.token_urlsafe(24) + "\n")
            path.chmod(0o600)
    return existing, settings.admin_token_file.read_text().strip()
