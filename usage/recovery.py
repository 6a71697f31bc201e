"""The loader's start-up (and after-error) recovery, which makes its batches exactly once (usage/loader.py).

A loader (writer `w`) commits batch `seq` as two Delta commits: the events carrying the application
transaction (`events:w`, seq), then their rollups carrying (`rollups:w`, seq). Killed between the two, the
events table is one version ahead: the missing rollup is rebuilt from the stored rows of those batches
(`load_writer = w`, `load_seq` in the gap) and committed with the events' version, so the rollups equal the
raw rows again. Then the de-duplication window is re-seeded from what the lake holds (events and rejects
loaded in the last window), so the batches Kafka re-delivers are recognised as already stored.
"""
from __future__ import annotations

import itertools
import logging
import operator
import time
from pathlib import Path

from usage import lake as lake_mod
from usage import rollups, store
from usage.dedup import RecentIds

log = logging.getLogger(__name__)


def recover(lake: lake_mod.Lake, store_path: Path, writer: str, recent: RecentIds) -> int:
    """Complete the writer's last batch if its rollups are missing, re-seed `recent`; returns the next batch number."""
    ev_v = lake_mod.txn_version(lake, lake_mod.EVENTS, f"events:{writer}")
    ro_v = lake_mod.txn_version(lake, lake_mod.ROLLUPS, f"rollups:{writer}")
    with store.connect(store_path, read_only=True, lake=lake) as con:
        if ro_v < ev_v:
            missing = con.sql("SELECT * FROM usage_events WHERE load_writer = $w AND load_seq > $lo "
                              "AND load_seq <= $hi", params={"w": writer, "lo": ro_v, "hi": ev_v}).to_arrow_table()
            lake_mod.append(lake, lake_mod.ROLLUPS, rollups.rollup(missing), txn=(f"rollups:{writer}", ev_v),
                            metadata={"writer": writer, "recovered": f"{ro_v + 1}..{ev_v}"})
            log.warning("usage loader %s: rebuilt the rollups of batches %d..%d from their events (%d rows)",
                        writer, ro_v + 1, ev_v, missing.num_rows)
        since = time.time() - recent.window_s
        # loaded_at / rejected_at row-group statistics prune everything older than the window.
        seen = con.execute("SELECT request_id, loaded_at FROM usage_events WHERE loaded_at >= ? "
                           "UNION ALL SELECT id, epoch(rejected_at) FROM usage_rejects WHERE rejected_at >= "
                           "to_timestamp(?) ORDER BY 2", [since, since]).fetchall()
    recent.clear()
    for at, group in itertools.groupby(seen, key=operator.itemgetter(1)):
        recent.add([rid for rid, _ in group], at=at)
    log.info("usage loader %s: next batch %d, %d ids in the de-duplication window", writer, ev_v + 1, len(recent))
    return ev_v + 1
