"""Token-weighted fair queueing between teams inside a tier (start-time fair queueing, Goyal et al. 1996).

Every request arriving at an admission queue gets a virtual start tag = max(virtual time, its team's last
finish tag) and a finish tag = start + tokens / weight, where tokens = prompt + max_tokens (what it may ask
of the replica) and weight = its team's `fair_weight` in the registry (default 1: equal shares). Waiting
requests of one tier and without deadlines are served in finish-tag order; serving one moves the virtual
time to its start tag. A backlogged team therefore gets replica tokens in proportion to its weight, a team
that just arrived starts at the current virtual time (it banks no credit for its idle time), and a team
sending 10x the others' rate only queues behind its own requests.

Tiers and deadlines still come first (AdmissionQueue's ticket order: tier, deadline, finish tag, arrival).

Several routers: each router keeps its own virtual clock per queue, and router_service/fair_sync.py shares
them through the registry database (virtual time = max over routers, a team's tags advanced by what other
routers tagged of it, and a router defers to another router's earlier waiting head), so shares hold when
connections are skewed.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_WEIGHT = 0.01


@dataclass(frozen=True)
class FairShare:
    """Who a request counts against and how much: team, the team's weight, tokens (prompt + max_tokens)."""
    team: str = ""
    weight: float = 1.0
    tokens: float = 1.0


class VirtualClock:
    """One admission queue's virtual time and each team's last finish tag."""

    def __init__(self) -> None:
        self.now = 0.0
        self.last_finish: dict[str, float] = {}
        self.tagged: dict[str, float] = {}   # each team's tokens / weight tagged here in all (fair_sync.py)

    def tag(self, share: FairShare) -> tuple[float, float]:
        """(start, finish) tags of an arriving request; the team's next request starts at `finish`."""
        start = max(self.now, self.last_finish.get(share.team, 0.0))
        cost = max(1.0, share.tokens) / max(MIN_WEIGHT, share.weight)
        finish = start + cost
        self.last_finish[share.team] = finish
        self.tagged[share.team] = self.tagged.get(share.team, 0.0) + cost
        if len(self.last_finish) > 10_000:  # bound memory: teams whose tags the clock has passed start at `now`
            self.last_finish = {t: f for t, f in self.last_finish.items() if f > self.now}
            self.tagged = {t: c for t, c in self.tagged.items() if t in self.last_finish}
        return start, finish

    def advance(self, team: str, cost: float) -> None:
        """Other routers tagged `cost` more of `team`'s requests (fair_sync.py): its next tag here comes after
        them, so a team spread over routers has one sequence of tags, not one per router."""
        self.last_finish[team] = max(self.now, self.last_finish.get(team, 0.0)) + cost

    def served(self, start: float) -> None:
        """A request with start tag `start` got its slot: virtual time moves on to it."""
        self.now = max(self.now, start)
