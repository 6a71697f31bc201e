"""Start the whole platform with `fleet up` on free ports and a throwaway data dir, as a user would."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from fleet.processes import port_open
from fleet.settings import REPO_ROOT


def _free_block(size: int) -> int:
    for _ in range(200):
        base = random.randrange(20000, 40000, 10)
        if not any(port_open("127.0.0.1", base + i) for i in range(size)):
            return base
    raise RuntimeError("no free port block")


@dataclass
class Platform:
    env: dict[str, str]
    data_dir: Path

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.env['FLEET_ROUTER_GRPC_PORT']}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.env['FLEET_ROUTER_HTTP_PORT']}"

    @property
    def api_key(self) -> str:
        return (self.data_dir / "dev-api-key").read_text().strip()

    @property
    def admin_token(self) -> str:
        return (self.data_dir / "admin-token").read_text().strip()

    def fleet(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fleet.cli", *args], env=self.env, cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=timeout)


def platform_env(data_dir: Path) -> dict[str, str]:
    base = _free_block(40)
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    env.update(FLEET_DATA_DIR=str(data_dir), FLEET_ROUTER_HTTP_PORT=str(base), FLEET_ROUTER_GRPC_PORT=str(base + 1),
               FLEET_ADMIN_UI_PORT=str(base + 2), FLEET_KAFKA_PORT=str(base + 3),
               FLEET_REPLICA_BASE_PORT=str(base + 10))
    return env
