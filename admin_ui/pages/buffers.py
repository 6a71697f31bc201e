"""Warm buffers & autoscaling: per model version min idle (warm) replicas, min / max replicas, SLO targets,
and what the autoscaler decided recently and why."""
import streamlit as st

from admin_ui import data, session

FIELDS = {"min_idle_replicas": "Min idle (warm) replicas", "min_replicas": "Min replicas",
          "max_replicas": "Max replicas", "slo_ttft_ms_p95": "SLO: TTFT p95 (ms)",
          "slo_tokens_per_s": "SLO: tokens/s per stream"}
DEFAULTS = {"min_idle_replicas": 0, "min_replicas": 1, "max_replicas": 1, "slo_ttft_ms_p95": 500,
            "slo_tokens_per_s": 40}

session.require_login()
session.header("Warm buffers & autoscaling", "Idle replicas kept warm, replica bounds and SLO targets")

buffers = session.safe("warm buffers (registry)", data.warm_buffers_frame)
if buffers is not None:
    if buffers.empty:
        st.info("No warm-buffer settings yet; the autoscaler uses its defaults.")
    else:
        st.dataframe(buffers, hide_index=True, width="stretch")

if session.is_operator():
    st.subheader("Change a model version's settings")
    versions = session.safe("model versions (registry)", data.versions_frame)
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
            else:
                session.write(lambda: session.client().set_warm_buffer(model, version, values),
                              f"{target} warm buffer saved", box)

st.subheader("Recent autoscaler decisions")
decisions = session.safe("autoscaler decisions", data.autoscaler_decisions, session.settings().data_dir)
if decisions is not None:
    if decisions.empty:
        st.info("No autoscaler decisions recorded yet.")
    else:
        st.dataframe(decisions, hide_index=True, width="stretch")
