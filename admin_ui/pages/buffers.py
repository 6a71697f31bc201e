"""Warm buffers & autoscaling: idle and serving replicas now against each pool's warm-buffer target, measured
cold starts, the buffer's cost per day, the settings (operators edit them), and the autoscaler's decisions
with the signals behind them over time."""
import streamlit as st

from admin_ui import buffers_data as bd, charts_history, data, session

FIELDS = {"min_idle_replicas": "Min idle (warm) replicas", "min_replicas": "Min replicas",
          "max_replicas": "Max replicas", "slo_ttft_ms_p95": "SLO: TTFT p95 (ms)",
          "slo_tokens_per_s": "SLO: tokens/s per stream"}
DEFAULTS = {"min_idle_replicas": 0, "min_replicas": 1, "max_replicas": 1, "slo_ttft_ms_p95": 500,
            "slo_tokens_per_s": 40}

session.require_login()
session.header("Warm buffers & autoscaling", "Idle replicas kept warm against their target, what they cost, "
                                             "and why the autoscaler scaled")
currency = session.currency()
price = bd.gpu_hour_price()
buffers = session.safe("warm buffers (registry)", data.warm_buffers_frame)
versions = session.safe("model versions (registry)", data.versions_frame)
fleet = session.safe("the live fleet state (router /admin/fleet)", session.client().fleet)
if buffers is not None and versions is not None:
    pools = bd.pools_now(fleet["replicas"] if fleet else [], buffers, versions, price)
    st.subheader("Now, per pool")
    if pools.empty:
        st.info("No pools: no replicas and no warm-buffer settings.")
    else:
        m = st.columns(4)
        m[0].metric("serving replicas", int(pools["serving"].sum()))
        m[1].metric("idle (warm) now", int(pools["idle"].sum()),
                    delta=f"{int(pools['idle'].sum() - pools['target_idle'].sum()):+d} vs target", delta_color="off")
        m[2].metric(f"buffer cost per day ({currency})", f"{pools['buffer_cost_per_day'].sum():,.2f}")
        colds = session.safe("cold starts (data dir)", bd.cold_starts, session.settings().data_dir)
        if colds is not None and not colds.empty:
            m[3].metric("cold start (p50, measured)", f"{colds['p50_s'].median():.1f} s")
        st.dataframe(pools, hide_index=True, width="stretch", column_config={
            "buffer_cost_per_day": st.column_config.NumberColumn(f"buffer cost / day ({currency})", format="%.2f")})
        st.caption(f"Idle = serving with nothing running or in flight. Buffer cost = target idle replicas x GPUs per "
                   f"replica x 24 h x {price:.2f} {currency} per GPU-hour (the capacity model's price). "
                   "A buffer bigger than (arrivals during one cold start) is money spent for nothing; a smaller one "
                   "means bursts wait a cold start.")
        if colds is not None and not colds.empty:
            st.dataframe(colds, hide_index=True, width=600, column_config={
                c: st.column_config.NumberColumn(c.replace("_s", " (s)"), format="%.1f")
                for c in ("last_s", "p50_s", "max_s")})

st.subheader("Settings")
if buffers is not None:
    st.dataframe(buffers, hide_index=True, width="stretch")

if session.is_operator():
    choices = [f"{r.model}/{r.version}" for r in versions.itertuples()] if versions is not None else []
    if choices:
        target = st.selectbox("Model version", choices, key="buffer_target")
        model, version = target.split("/", 1)
        current = DEFAULTS
        if buffers is not None:
            match = buffers[(buffers["model"] == model) & (buffers["version"] == version)]
            if not match.empty:
                current = {f: int(match.iloc[0][f]) for f in FIELDS}
        with st.form("warm_buffer"):
            cols = st.columns(len(FIELDS))
            values, slots = {}, {}
            for col, (field, label) in zip(cols, FIELDS.items()):
                values[field] = int(col.number_input(label, value=current[field], step=1, key=f"wb_{field}"))
                slots[field] = col.empty()
            saved = st.form_submit_button("Save")
        box = st.container()
        if saved:
            problems = data.validate_warm_buffer(values)
            for field, message in problems.items():
                slots[field].error(message)
            if problems:
                box.error("Not changed: fix the fields marked above.")
            elif values == current:
                box.info("These are the current settings; nothing to save.")
            else:
                session.write(lambda: session.client().set_warm_buffer(model, version, values),
                              f"{target} warm buffer saved", box)

st.subheader("Autoscaler decisions")
got = session.safe("autoscaler decisions", bd.decisions, session.settings().data_dir)
if got is not None:
    decisions, signals = got
    if decisions.empty:
        st.info("No scaling decisions recorded yet (the autoscaler records one each time it changes a pool's size).")
    else:
        left, right = st.columns(2)
        left.plotly_chart(charts_history.buffer_timeline(decisions), width="stretch")
        if not signals.empty:
            right.plotly_chart(charts_history.signal_timeline(signals), width="stretch")
        st.dataframe(decisions.iloc[::-1], hide_index=True, width="stretch",
                     column_config={"at": st.column_config.DatetimeColumn("at (UTC)", format="YYYY-MM-DD HH:mm:ss")})
