"""The warm-buffer page's context: idle and serving replicas now against each pool's target, measured
cold starts, what the buffer costs per day, and the autoscaler's decisions with the signals behind them."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from common.settings import REPO_ROOT

ASSUMPTIONS = REPO_ROOT / "autoscale" / "simulator" / "assumptions.json"
DEFAULT_GPU_HOUR_PRICE = 2.5
SIGNALS = {"kv": "KV used (0..1)", "running": "running", "waiting": "waiting", "ttft_p95_s": "TTFT p95 (s)",
           "queue_wait_p95_s": "queue wait p95 (s)", "load": "engine load (0..1)"}
POOL_COLUMNS = ["model", "version", "serving", "idle", "busy", "target_idle", "min_replicas", "max_replicas",
                "buffer", "gpus_per_replica", "buffer_cost_per_day"]


def gpu_hour_price() -> float:
    """The GPU-hour price the capacity model uses (autoscale/simulator/assumptions.json), in the platform currency."""
    try:
        return float(json.loads(ASSUMPTIONS.read_text()).get("gpu_hour_price_usd", DEFAULT_GPU_HOUR_PRICE))
    except (OSError, ValueError):
        return DEFAULT_GPU_HOUR_PRICE


def pools_now(replicas: list[dict], buffers: pd.DataFrame, versions: pd.DataFrame, price: float) -> pd.DataFrame:
    """Per model version: serving replicas, how many are idle (nothing running or in flight) vs the warm-buffer
    target, and the buffer's cost per day (target idle replicas x GPUs each x 24 h x price)."""
    rows = []
    keys = {(b.model, b.version) for b in buffers.itertuples()} | {(r.get("model"), r.get("version")) for r in replicas}
    for model, version in sorted(k for k in keys if k[0]):
        mine = [r for r in replicas if r.get("model") == model and r.get("version") == version
                and r.get("state") == "serving"]
        idle = sum(1 for r in mine if not r.get("inflight") and not r.get("running"))
        b = buffers[(buffers["model"] == model) & (buffers["version"] == version)]
        target = int(b["min_idle_replicas"].iloc[0]) if not b.empty else 0
        v = versions[(versions["model"] == model) & (versions["version"] == version)]
        gpus = int(v["tensor_parallel"].iloc[0]) if not v.empty else 1
        rows.append({"model": model, "version": version, "serving": len(mine), "idle": idle,
                     "busy": len(mine) - idle, "target_idle": target,
                     "min_replicas": int(b["min_replicas"].iloc[0]) if not b.empty else None,
                     "max_replicas": int(b["max_replicas"].iloc[0]) if not b.empty else None,
                     "buffer": "ok" if idle >= target else f"short by {target - idle}",
                     "gpus_per_replica": gpus, "buffer_cost_per_day": round(target * gpus * 24 * price, 2)})
    return pd.DataFrame(rows, columns=POOL_COLUMNS)


def cold_starts(data_dir: Path) -> pd.DataFrame:
    """Measured cold starts (spawn -> ready) per model: from the autoscaler's record and `fleet up`'s replicas."""
    seconds: dict[str, list[float]] = {}
    try:
        for model, values in json.loads((data_dir / "autoscale" / "cold_starts.json").read_text()).items():
            seconds.setdefault(model, []).extend(float(v) for v in values)
    except (OSError, ValueError):
        pass
    run_dir = data_dir / "run"
    for path in sorted(run_dir.glob("*.json")) if run_dir.exists() else []:
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if info.get("kind") == "replica" and info.get("cold_start_s") is not None:
            seconds.setdefault(str(info.get("model", "?")), []).append(float(info["cold_start_s"]))
    rows = [{"model": m, "cold_starts": len(v), "last_s": v[-1], "p50_s": float(pd.Series(v).median()),
             "max_s": max(v)} for m, v in sorted(seconds.items()) if v]
    return pd.DataFrame(rows, columns=["model", "cold_starts", "last_s", "p50_s", "max_s"])


def decisions(data_dir: Path, limit: int = 500) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The autoscaler's recorded decisions (newest last) as (one row per decision with a `why` text naming
    the signals, one row per decision and signal for charting)."""
    path = Path(data_dir) / "autoscale" / "decisions.jsonl"
    rows, long = [], []
    for line in path.read_text().splitlines()[-limit:] if path.exists() else []:
        try:
            d = json.loads(line)
        except ValueError:
            continue
        at = pd.to_datetime(d.get("ts") or d.get("at"), unit="s", utc=True)
        signals = d.get("signals") or {}
        pool = d.get("pool") or "/".join(str(d[k]) for k in ("model", "version") if d.get(k))
        shown = ", ".join(f"{label} {_num(signals[k])}" for k, label in SIGNALS.items() if k in signals)
        rows.append({"at": at, "pool": pool, "serving": d.get("serving"), "starting": d.get("starting"),
                     "desired": d.get("desired"), "why": f"{d.get('reason', 'decision')}: {shown}".rstrip(": ")})
        long += [{"at": at, "pool": pool, "signal": label, "signal_value": float(signals[k])}
                 for k, label in SIGNALS.items() if isinstance(signals.get(k), (int, float))]
    return (pd.DataFrame(rows, columns=["at", "pool", "serving", "starting", "desired", "why"]),
            pd.DataFrame(long, columns=["at", "pool", "signal", "signal_value"]))


def _num(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
