"""First-run registry contents for a local platform: the SmolLM2 route, a dev team and caller, admin
(operator) and viewer tokens."""
from __future__ import annotations

import json
import shutil

from common.settings import REPO_ROOT, Settings
from registry import queries
from registry.admin_tokens import ensure_admin_token, new_admin_token
from registry.db import session_scope
from registry.schema import WarmBuffer

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_VERSION = "1"
DEV_TEAM = "dev-team"
SHIPPED_ADAPTERS = REPO_ROOT / "adapters" / DEFAULT_MODEL  # trained by python_backends/engine/lora_train.py


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
            existing = queries.create_caller(s, "dev", DEV_TEAM, api_key=existing or None)
            settings.dev_api_key_file.write_text(existing + "\n")
            settings.dev_api_key_file.chmod(0o600)
        if not s.query(WarmBuffer).filter_by(model=DEFAULT_MODEL, version=DEFAULT_VERSION).first():
            # CPU-replica SLOs: a 135M model on 2 cores has a ~1 s TTFT; the GPU tiers' 500 ms would make the
            # autoscaler start a second replica on the first request.
            s.add(WarmBuffer(model=DEFAULT_MODEL, version=DEFAULT_VERSION, min_idle_replicas=0, min_replicas=1,
                             max_replicas=2, slo_ttft_ms_p95=3000, slo_tokens_per_s=10))
    install_shipped_adapters(settings)
    tokens: dict[str, str] = {}
    # the local operator "admin" and viewer "viewer": plaintext only in the data dir's 0600 files (for `make up`
    # and the admin UI), hashed in the registry; named tokens for people come from `fleet admin-token create`
    for name, role, path, given in (("admin", "operator", settings.admin_token_file, settings.admin_token),
                                    ("viewer", "viewer", settings.viewer_token_file, settings.viewer_token)):
        token = given or (path.read_text().strip() if path.exists() else "")
        if not token:
            token = new_admin_token(role)
            path.write_text(token + "\n")
            path.chmod(0o600)
        with session_scope(settings.db_url) as s:
            ensure_admin_token(s, name, role, token)
        tokens[name] = token
    return existing, tokens["admin"]


def install_shipped_adapters(settings: Settings) -> list[str]:
    """Copy the repo's trained LoRA adapters into the replicas' adapters dir and register them (team dev-team)."""
    names = []
    target_root = settings.data_dir / "adapters"  # the `adapters_dir` build_engines writes into engine configs
    for src in sorted(p for p in SHIPPED_ADAPTERS.iterdir() if (p / "adapter_config.json").exists()):
        dst = target_root / src.name
        if not dst.exists():
            shutil.copytree(src, dst)
        rank = int(json.loads((src / "adapter_config.json").read_text()).get("r", 8))
        with session_scope(settings.db_url) as s:
            queries.upsert_adapter(s, src.name, DEFAULT_MODEL, DEFAULT_VERSION, str(dst), rank, DEV_TEAM)
        names.append(src.name)
    return names
