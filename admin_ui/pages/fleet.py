"""Fleet: the routers (each one's own view: up, in flight, queued, admitted/s; admin_ui/router_tier.py),
replicas as the router sees them now (state, KV use, queue, TTFT p95 vs SLO, tokens/s), and the
router's metrics over a chosen time range (kept by the metrics scraper): p95 over a stated window with its
age, tokens/s, error rate, queue wait, queue depth and KV use. Operators cordon/drain with a confirmation."""
import time
from datetime import datetime, timezone

import streamlit as st

from admin_ui import charts, charts_history, data, fleet_history as fh, router_tier, session, url_state
from admin_ui.usage_data import store_path

session.require_login()
session.header("Fleet", "Replicas now, and the router's metrics over time")
live = st.toggle("Live refresh every 5 s", value=True, key="fleet_live")


@st.fragment(run_every=5 if live else None)
def live_view() -> None:
    fleet = session.safe("the live fleet state (router /admin/fleet)", session.client().fleet)
    slos = session.safe("SLO targets (registry)", data.slo_targets) or {}
    if fleet is None:
        replicas = session.safe("registered replicas (registry)", data.registry_replicas) or []
        st.info("Showing replicas as registered; live KV, queue and latency numbers need the router.")
    else:
        replicas = fleet["replicas"]
        st.caption(f"registry version {fleet['registry_version']} · routes {fleet['routes']} · "
                   f"updated {datetime.now(timezone.utc):%H:%M:%S} UTC")
    frame = data.fleet_frame(replicas, slos)
    if frame.empty:
        st.info("No replicas are registered.")
        routers_view()
        return
    states = frame["state"].value_counts()
    cols = st.columns(5)
    cols[0].metric("serving", int(states.get("serving", 0)))
    cols[1].metric("draining", int(states.get("draining", 0)))
    cols[2].metric("cordoned", int(states.get("cordoned", 0)))
    cols[3].metric("queued requests", int(frame["waiting"].fillna(0).sum()))
    cols[4].metric("tokens/s (replica reports)", f"{frame['tokens_per_s'].fillna(0).sum():.1f}")
    st.dataframe(data.fleet_rollup(frame), hide_index=True, width="stretch",
                 column_config={"tokens_per_s": st.column_config.NumberColumn("tokens/s", format="%.1f")})
    st.dataframe(frame, hide_index=True, width="stretch", column_order=data.FLEET_VIEW_ORDER, column_config={
        "kv_utilisation": st.column_config.ProgressColumn("KV used", min_value=0.0, max_value=1.0, format="percent"),
        "ttft_ms_p95": st.column_config.NumberColumn("TTFT p95 (ms)", format="%.0f"),
        "slo_ttft_ms_p95": st.column_config.NumberColumn("SLO (ms)", format="%d"),
        "meets_slo": st.column_config.CheckboxColumn("meets SLO"),
        "queue_wait_ms_p95": st.column_config.NumberColumn("queue wait p95 (ms)", format="%.0f"),
        "tokens_per_s": st.column_config.NumberColumn("tokens/s", format="%.1f")})
    if fleet is not None:
        left, right = st.columns(2)
        left.plotly_chart(charts.ttft_vs_slo(frame), width="stretch", key="fleet_ttft")
        right.plotly_chart(charts.kv_and_queue(frame), width="stretch", key="fleet_kv")
    routers_view()


def routers_view() -> None:
    """Each router's own view (several routers share the callers' port: docs/router.md, Several routers)."""
    cfg = session.settings()
    routers = session.safe("the routers' own metrics", router_tier.routers_frame, cfg.router_metrics_urls,
                           store_path(), None, cfg.metrics_scrape_s)
    if routers is None:
        return
    up = int(routers["up"].sum())
    st.markdown(f"**Routers**: {up} of {len(routers)} up")
    st.caption("in flight and queued: read from each router now; "
               "admitted/s: requests admitted and finished per second between the metrics scraper's two newest scrapes")
    st.dataframe(routers, hide_index=True, width="stretch", column_config={
        "up": st.column_config.CheckboxColumn("up"),
        "inflight": st.column_config.NumberColumn("in flight", format="%d"),
        "queued": st.column_config.NumberColumn("queued", format="%d"),
        "admitted_per_s": st.column_config.NumberColumn("admitted/s", format="%.1f"),
        "error": st.column_config.TextColumn("why down")})


live_view()

st.subheader("History")
c1, c2, c3 = st.columns([2, 2, 3])
range_key = c1.segmented_control("Time range", list(fh.RANGES), key="fleet_range",
                                 default=url_state.initial("range", "1h", list(fh.RANGES))) or "1h"
window_key = c2.segmented_control("p95 window", list(fh.WINDOWS), key="fleet_window",
                                  default=url_state.initial("window", "5 min", list(fh.WINDOWS))) or "5 min"
url_state.publish(range=range_key, window=window_key)
now = time.time()
head = session.safe("p95 over the window (metrics history)", fh.headline, fh.WINDOWS[window_key], now,
                    session.settings().metrics_scrape_s)
hist = session.safe("the metrics history (usage store)", fh.history, range_key, now, session.settings().metrics_scrape_s)
if head is not None:
    m = st.columns(4)
    for col, key, label in ((m[0], "ttft", "TTFT p95"), (m[1], "queue_wait", "queue wait p95")):
        h = head[key]
        col.metric(f"{label}, last {window_key}", "no requests" if h["value_ms"] is None else f"{h['value_ms']:.0f} ms")
        col.caption(f"{h['observations']} requests · as of {fh.age_text(h['as_of'], now)} · newest request "
                    f"{fh.age_text(h['last_observed'], now)}")
    if head["tokens_per_s"] is not None:
        m[2].metric("tokens/s, last scrape interval", f"{head['tokens_per_s']:.1f}")
        m[3].metric("error rate, last scrape interval", f"{head['error_rate']:.1%}")
if hist is not None:
    if hist.empty:
        st.info("No metrics history yet: the metrics scraper (`fleet usage scrape-metrics`, started by `fleet up`) "
                "keeps the router's metrics every few seconds.")
    else:
        x_range = (datetime.fromtimestamp(now - hist.range_s, timezone.utc), datetime.fromtimestamp(now, timezone.utc))
        st.caption(f"Each point covers {hist.step_s:.0f} s; p95 points are the requests finished in that interval.")
        left, right = st.columns(2)
        left.plotly_chart(charts_history.lines(hist.tokens_per_s, "rate", "Tokens/s streamed (0 when idle)",
                                               "tokens/s", x_range=x_range), width="stretch")
        right.plotly_chart(charts_history.lines(hist.error_rate, "error_rate", "Error rate", "errors",
                                                x_range=x_range, percent=True), width="stretch")
        left, right = st.columns(2)
        left.plotly_chart(charts_history.lines(hist.ttft_p95, "value_ms", "TTFT p95 by tier", "ms", "tier",
                                               x_range=x_range), width="stretch")
        right.plotly_chart(charts_history.lines(hist.queue_wait_p95, "value_ms", "Admission queue wait p95 by tier",
                                                "ms", "tier", x_range=x_range), width="stretch")
        left, right = st.columns(2)
        left.plotly_chart(charts_history.lines(hist.kv, "value", "KV-cache use by replica", "KV used", "replica",
                                               x_range=x_range, percent=True), width="stretch")
        right.plotly_chart(charts_history.lines(hist.queue_depth, "value", "Requests in the admission queue",
                                                "waiting", x_range=x_range), width="stretch")

if session.is_operator():
    st.subheader("Replica actions")
    replicas = session.safe("registered replicas (registry)", data.registry_replicas) or []
    c1, c2, c3 = st.columns([3, 2, 2])
    replica_id = c1.selectbox("Replica", [r["replica_id"] for r in replicas], key="replica_pick")
    action = c2.selectbox("Action", ["cordon", "drain", "uncordon"], key="replica_action_pick")
    box = st.container()
    if c3.button("Apply…", key="replica_apply") and replica_id:
        st.session_state["pending_replica"] = (replica_id, action)
    if replica_id and st.session_state.get("pending_replica") == (replica_id, action):
        effect = {"cordon": "stops getting new requests (streams in flight finish)",
                  "drain": "stops getting new requests and is stopped once its streams finish",
                  "uncordon": "gets new requests again"}[action]
        box.warning(f"**{action}** `{replica_id}`: it {effect}.")
        y, n = box.columns(2)
        if y.button(f"Confirm {action}", key="replica_confirm", type="primary"):
            st.session_state.pop("pending_replica", None)
            session.write(lambda: session.client().replica_action(replica_id, action), f"{replica_id}: {action}", box)
        if n.button("Cancel", key="replica_cancel"):
            st.session_state.pop("pending_replica", None)
            st.rerun()
