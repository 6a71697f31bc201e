"""Replica choice: prefix affinity + load, with a bounded-load cap, adapter preference and a
round-robin fallback when state reports stop (docs/architecture.md, One request, step 4).

cost(replica) = uncached prefill tokens on that replica + load_weight x its load (running + queued tokens)
              + adapter_miss_tokens if the request's adapter is not loaded there.
Bounded load: a replica whose load is above (1 + epsilon) x the mean load (the mean counting this request)
is skipped, even if it holds the prefix (consistent hashing with bounded loads, Mirrokni et al. 2018).

A prefix no replica holds yet (no cached or just-sent leading block anywhere) goes to the replica its first
block hash ranks highest (rendezvous hashing) among those under the cap: every router makes the same choice
without coordination, so two routers taking the first requests of a new system prompt at the same moment
(before any report shows its blocks) send them to one replica instead of one copy each. With the cost rule
they would both pick their own least-loaded replica, and the two routers' load views differ.

`pick` is a pure function over `ReplicaView`s so the policy simulator in bench/router runs exactly the
code the router runs. `ReplicaChooser` keeps the router's own view of each replica's load (tokens it sent
and has not yet seen streamed back), which is fresher than the 200 ms reports, and adds the streams other
routers hold there (router_service/shared_load.py) to the concurrency cap and the load term.
"""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from router_service.registry_cache import ReplicaInfo
from router_service.replica_state import DEFAULT_BLOCK_SIZE, ReplicaStateTable
from router_service.shared_load import SharedLoad


@dataclass(frozen=True)
class ChoiceParams:
    load_weight: float = 0.5          # tokens of load worth one token of uncached prefill (tuned in bench/router)
    epsilon: float = 0.25             # bounded-load slack: skip replicas above (1 + epsilon) x mean
    adapter_miss_tokens: int = 256    # cost of loading an adapter that is not resident
    replica_concurrency: int = 64     # streams in flight per replica (router side) at most (engine max_num_seqs)
    batch_share: float = 0.75         # batch streams may use at most this share of a replica's slots
    policy: str = "ours"              # ours | round_robin | least_loaded | prefix_hash (baselines for benchmarks)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"FLEET_ROUTER_POLICY must be one of {', '.join(POLICIES)}, not {self.policy!r}")


@dataclass
class ReplicaView:
    replica_id: str
    load: float            # running + queued tokens
    cached_blocks: int     # leading prompt blocks cached there
    has_adapter: bool = True


def pick(views: Sequence[ReplicaView], prompt_len: int, block_size: int, new_load: float,
         params: ChoiceParams, first_block_hash: int | None = None) -> int:
    """Index of the replica to use ("ours"): least cost among replicas under the bounded-load cap; a new
    prefix (`first_block_hash` cached nowhere) by rendezvous hashing among them."""
    mean = (sum(v.load for v in views) + new_load) / len(views)
    cap = (1.0 + params.epsilon) * mean
    allowed = [i for i, v in enumerate(views) if v.load <= cap] or \
        [min(range(len(views)), key=lambda i: views[i].load)]
    if first_block_hash is not None and not any(v.cached_blocks for v in views):
        pool = [i for i in allowed if views[i].has_adapter] or allowed
        return max(pool, key=lambda i: rendezvous(first_block_hash, views[i].replica_id))

    def cost(i: int) -> tuple[float, float]:
        v = views[i]
        uncached = max(0, prompt_len - v.cached_blocks * block_size)
        miss = 0 if v.has_adapter else params.adapter_miss_tokens
        return uncached + params.load_weight * v.load + miss, v.load
    return min(allowed, key=cost)


def pick_least_loaded(views: Sequence[ReplicaView]) -> int:
    return min(range(len(views)), key=lambda i: views[i].load)


def pick_prefix_hash(views: Sequence[ReplicaView], first_block_hash: int | None, vnodes: int = 64) -> int:
    """Consistent hashing of the prompt's first block onto a ring of replica ids (no load bound)."""
    if first_block_hash is None:
        return 0
    ring = sorted((_h(f"{v.replica_id}#{k}"), i) for i, v in enumerate(views) for k in range(vnodes))
    key = first_block_hash % (1 << 64)
    for point, i in ring:
        if point >= key:
            return i
    return ring[0][1]


def rendezvous(key: int, replica_id: str) -> int:
    """Highest-random-weight score of `replica_id` for `key`: the same on every router, and removing a
    replica moves only the keys it ranked first."""
    return _h(f"{key % (1 << 64)}@{replica_id}")


def _h(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


POLICIES = ("ours", "round_robin", "least_loaded", "prefix_hash")


@dataclass
class Placement:
    """A reserved slot on one replica; `ReplicaChooser.release` gives it back."""
    replica: ReplicaInfo
    tier: str
    load: float
    cached_tokens: int
    policy: str  # "cost" or "round_robin"
    shared_id: int = -1  # its entry in SharedLoad


class ReplicaChooser:
    def __init__(self, states: ReplicaStateTable, params: ChoiceParams | None = None) -> None:
        self.states = states
        self.params = params or ChoiceParams()
        self.inflight: dict[str, int] = {}
        self.batch_inflight: dict[str, int] = {}
        self.load: dict[str, float] = {}
        self.shared = SharedLoad(states)
        self._rr = itertools.count()

    def has_room(self, replica_id: str, tier: str) -> bool:
        n, cap = self.inflight.get(replica_id, 0) + self.shared.others(replica_id), self.params.replica_concurrency
        if n >= cap:
            return False
        state = self.states.fresh(replica_id)
        if state is not None and state.report.get("draining"):
            return False
        if tier == "batch":
            return self.batch_inflight.get(replica_id, 0) < max(1, int(cap * self.params.batch_share))
        return True

    def block_size(self, replicas: Sequence[ReplicaInfo]) -> int | None:
        """The block size of the first reporting replica, or None when no replica reports (fallback mode)."""
        for r in replicas:
            state = self.states.fresh(r.replica_id)
            if state is not None:
                return state.block_size
        return None

    def place(self, replicas: Sequence[ReplicaInfo], tier: str, prompt_len: int, max_tokens: int,
              hashes: list[int] | None, adapter: str) -> Placement | None:
        """Choose among `replicas` and reserve a slot there; None when none has room.

        `hashes`: the prompt's block hashes at the reporting replicas' block size (None = no reports).
        """
        room = [r for r in replicas if self.has_room(r.replica_id, tier)]
        if not room:
            return None
        reporting = hashes is not None and any(self.states.fresh(r.replica_id) for r in room)
        if not reporting or self.params.policy == "round_robin":
            replica = room[next(self._rr) % len(room)]
            return self._reserve(replica, tier, prompt_len + max_tokens, 0, "round_robin", [])
        block_size = self.block_size(room) or DEFAULT_BLOCK_SIZE
        views = []
        for r in room:
            state = self.states.fresh(r.replica_id)
            views.append(ReplicaView(r.replica_id, self._load_all_routers(r.replica_id, prompt_len + max_tokens),
                                     self.states.cached_blocks(r.replica_id, hashes),
                                     not adapter or (state is not None and adapter in state.adapters)))
        if self.params.policy == "least_loaded":
            i = pick_least_loaded(views)
        elif self.params.policy == "prefix_hash":
            i = pick_prefix_hash(views, hashes[0] if hashes else None)
        else:
            i = pick(views, prompt_len, block_size, prompt_len + max_tokens, self.params,
                     hashes[0] if hashes else None)
        cached = min(prompt_len, views[i].cached_blocks * block_size)
        return self._reserve(room[i], tier, prompt_len - cached + max_tokens, cached, "cost", hashes)

    def _load_all_routers(self, replica_id: str, tokens_if_idle: float) -> float:
        """This router's token load plus the other routers' streams there at this router's mean stream load."""
        own, n = self.load.get(replica_id, 0.0), self.inflight.get(replica_id, 0)
        others = self.shared.others(replica_id)
        return own + others * (own / n if n else tokens_if_idle) if others else own

    def _reserve(self, replica: ReplicaInfo, tier: str, load: float, cached: int, policy: str,
                 hashes: list[int]) -> Placement:
        rid = replica.replica_id
        self.inflight[rid] = self.inflight.get(rid, 0) + 1
        if tier == "batch":
            self.batch_inflight[rid] = self.batch_inflight.get(rid, 0) + 1
        self.load[rid] = self.load.get(rid, 0.0) + load
        self.states.note_routed(rid, hashes)
        return Placement(replica, tier, load, cached, policy, self.shared.opened(rid))

    def progress(self, placement: Placement, tokens: float) -> None:
        """The replica worked off `tokens` of this request's load (prefill done or tokens streamed)."""
        tokens = min(tokens, placement.load)
        placement.load -= tokens
        rid = placement.replica.replica_id
        self.load[rid] = max(0.0, self.load.get(rid, 0.0) - tokens)

    def release(self, placement: Placement) -> None:
        rid = placement.replica.replica_id
        self.progress(placement, placement.load)
        self.shared.closed(rid, placement.shared_id)
        self.inflight[rid] = max(0, self.inflight.get(rid, 0) - 1)
        if placement.tier == "batch":
            self.batch_inflight[rid] = max(0, self.batch_inflight.get(rid, 0) - 1)
