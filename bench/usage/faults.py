"""Usage pipeline fault runs with the real broker (issue 5, "Measured"): every event must land exactly once.

Scenarios (see usage/faultcheck.py):
- broker_outage_pause:   steady load; broker frozen (SIGSTOP) for --outage-s, then resumed;
- broker_outage_restart: steady load; broker killed, restarted empty on the same port after --outage-s
                         (the embedded tansu keeps its log in memory only);
- loader_kill:           steady load; loader killed inside its store transaction, after it before the
                         offset commit, then --kills times at a random moment, restarted each time;
- router_kill:           a router process SIGKILLed with its events still spooled (broker down), restarted.
Writes bench/results/usage-faults.json; exit code 1 if any scenario lost or duplicated an event.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from common.settings import load_settings  # noqa: E402
from usage import faultcheck  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--outage-s", type=float, default=30.0, help="broker outage (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=300.0,
                        help="steady load during the outage runs, events/s (default: %(default)s)")
    parser.add_argument("--kills", type=int, default=3, help="random-moment loader kills (default: %(default)s)")
    parser.add_argument("--only", choices=("pause", "restart", "loader", "router"), action="append",
                        help="run only these scenarios (repeatable)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "usage-faults.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)
    settings = load_settings()
    only = set(args.only or ("pause", "restart", "loader", "router"))
    results = []
    work = Path(tempfile.mkdtemp(prefix="usage-faults-"))
    try:
        for name in ("pause", "restart", "loader", "router"):
            if name not in only:
                continue
            d = work / name
            d.mkdir()
            t0 = time.monotonic()
            print(f"{name} ...", flush=True)
            if name in ("pause", "restart"):
                res = faultcheck.broker_outage(settings, d, args.outage_s, mode=name, rate=args.rate)
            elif name == "loader":
                res = faultcheck.loader_kill(settings, d, kills=args.kills, interval_s=8.0, rate=2000.0)
            else:
                res = faultcheck.router_kill(settings, d, rate=2000.0, run_s=5.0, broker_down=True)
            res["wall_s"] = round(time.monotonic() - t0, 1)
            res["exactly_once"] = res["missing"] == 0 and res["duplicates"] == 0 and res["unexpected"] == 0 \
                and res["rollup_requests_off"] == 0 and res["rollup_tokens_off"] == 0  # rollups == raw rows
            print(json.dumps(res), flush=True)
            results.append(res)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"bench": "usage-faults", "host": platform.node(), "started": time.time(),
           "load_average_1m": round(os.getloadavg()[0], 2),
           "command": "python bench/usage/faults.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "all_exactly_once": all(r["exactly_once"] for r in results), "scenarios": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}; all exactly once: {out['all_exactly_once']}")
    return 0 if out["all_exactly_once"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
