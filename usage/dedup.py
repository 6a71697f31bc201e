"""The loader's de-duplication window: the request_ids (and reject ids) it stored in the last `window_s`
seconds of loading, so a redelivered or resent event is dropped without a primary-key index over all
history.

Why a window is enough: a repeat reaches the loader only as (a) Kafka redelivery of batches whose offsets
were not committed (seconds), (b) the producer's replay of recently acknowledged events after a broker
reconnect (usage/producer.py REPLAY_WINDOW_S, 30 s), (c) a restarted router resending its spool (events
the broker never acknowledged, or acknowledged moments before the crash). The default window (15 min) is
30x the longest of these. Events sharing a request_id always share a caller, hence a Kafka partition, hence
a loader worker. Memory: ~100 bytes per id, ~3,500 ids/s at the requirements' peak -> ~300 MB at 15 min.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

DEFAULT_WINDOW_S = 900.0


class RecentIds:
    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.window_s = window_s
        self._ids: set[str] = set()
        self._batches: deque[tuple[float, list[str]]] = deque()

    def __contains__(self, item: str) -> bool:
        return item in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, ids: Iterable[str], at: float | None = None) -> None:
        batch = [i for i in ids if i not in self._ids]
        if batch:
            self._ids.update(batch)
            self._batches.append((time.time() if at is None else at, batch))
        self.expire()

    def expire(self, now: float | None = None) -> None:
        cutoff = (time.time() if now is None else now) - self.window_s
        while self._batches and self._batches[0][0] < cutoff:
            self._ids.difference_update(self._batches.popleft()[1])

    def clear(self) -> None:
        self._ids.clear()
        self._batches.clear()
