"""Fleet: replicas per model / version / region with state, KV use, queue, TTFT p95 vs SLO, tokens/s (live)."""
from datetime import datetime, timezone

import pandas as pd
import streamlit as st

from admin_ui import charts, data, session

session.require_login()
session.header("Fleet", "Replicas as the router sees them, refreshed live")
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
        return
    states = frame["state"].value_counts()
    cols = st.columns(5)
    cols[0].metric("serving", int(states.get("serving", 0)))
    cols[1].metric("draining", int(states.get("draining", 0)))
    cols[2].metric("cordoned", int(states.get("cordoned", 0)))
    cols[3].metric("queued requests", int(frame["waiting"].fillna(0).sum()))
    cols[4].metric("tokens/s", f"{frame['tokens_per_s'].fillna(0).sum():.1f}")
    st.subheader("By model, version and region")
    st.dataframe(data.fleet_rollup(frame), hide_index=True, width="stretch",
                 column_config={"tokens_per_s": st.column_config.NumberColumn("tokens/s", format="%.1f")})
    st.subheader("Replicas")
    st.dataframe(frame, hide_index=True, width="stretch", column_order=data.FLEET_VIEW_ORDER, column_config={
        "kv_utilisation": st.column_config.ProgressColumn("KV used", min_value=0.0, max_value=1.0, format="percent"),
        "ttft_ms_p95": st.column_config.NumberColumn("TTFT p95 (ms)", format="%.0f"),
        "slo_ttft_ms_p95": st.column_config.NumberColumn("SLO (ms)", format="%d"),
        "meets_slo": st.column_config.CheckboxColumn("meets SLO"),
        "queue_wait_ms_p95": st.column_config.NumberColumn("queue wait p95 (ms)", format="%.0f"),
        "tokens_per_s": st.column_config.NumberColumn("tokens/s", format="%.1f")})
    if fleet is not None:
        st.session_state["fleet_history"] = data.append_sample(st.session_state.get("fleet_history", []), frame,
                                                               datetime.now(timezone.utc))
        left, right = st.columns(2)
        left.plotly_chart(charts.ttft_vs_slo(frame), width="stretch", key="fleet_ttft")
        right.plotly_chart(charts.kv_and_queue(frame), width="stretch", key="fleet_kv")
        st.plotly_chart(charts.live_history(pd.DataFrame(st.session_state["fleet_history"])), width="stretch",
                        key="fleet_history_chart")


live_view()

if session.is_operator():
    st.subheader("Replica actions")
    replicas = session.safe("registered replicas (registry)", data.registry_replicas) or []
    with st.form("replica_action"):
        c1, c2 = st.columns(2)
        replica_id = c1.selectbox("Replica", [r["replica_id"] for r in replicas], key="replica_pick")
        action = c2.selectbox("Action", ["cordon", "drain", "uncordon"], key="replica_action_pick")
        go = st.form_submit_button("Apply")
    if go and replica_id:
        session.write(lambda: session.client().replica_action(replica_id, action), f"{replica_id}: {action}")
