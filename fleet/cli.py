"""The `fleet` command: run the local platform and reach each component's commands."""
from __future__ import annotations

import argparse
import importlib
import inspect

from common.logs import setup_logging
from common.settings import load_settings

# Component command groups: module path -> each provides `register(subparsers)`.
COMPONENT_COMMANDS = ("usage.cli", "autoscale.cli", "registry.admin_tokens")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet", description="LLM serving platform: start/stop the local platform, meter usage, simulate "
                                  "the fleet. Ports and paths come from FLEET_* env vars "
                                  "(docs/architecture.md, Ports and settings).")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the whole platform locally (idempotent) and print its endpoints")
    up.add_argument("--routers", type=int, choices=range(1, 17), metavar="N", default=None,
                    help="router processes sharing the callers' ports (SO_REUSEPORT); default FLEET_ROUTERS or 1")
    up.set_defaults(handler="up")
    for name, help_text in (("down", "stop every process `fleet up` started"),
                            ("status", "show the platform's processes"),
                            ("seed", "create the dev caller, admin token and default route if missing")):
        sub.add_parser(name, help=help_text).set_defaults(handler=name)
    for module in COMPONENT_COMMANDS:
        try:
            importlib.import_module(module).register(sub)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    settings = load_settings()
    setup_logging("fleet", settings.log_level)
    handler = args.handler
    if callable(handler):  # component commands take (args) or (args, settings)
        params = inspect.signature(handler).parameters
        handler(args, settings) if len(params) >= 2 else handler(args)
        return
    from fleet import platform
    from fleet.seed import seed
    if getattr(args, "routers", None):  # the processes `up` starts get it as FLEET_ROUTERS (platform.child_env)
        settings = settings.model_copy(update={"routers": args.routers})
    if handler == "seed":
        from registry.db import migrate
        migrate(settings.db_url)
        key, _ = seed(settings)
        print(f"dev API key: {key}")
    else:
        getattr(platform, handler)(settings)


if __name__ == "__main__":
    main()
