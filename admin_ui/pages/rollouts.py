"""Models & rollouts: versions with status and build info, percent split, promote / roll back (confirmed),
a side-by-side comparison of the versions under rollout, and the audit log."""
import streamlit as st

from admin_ui import charts, data, session, usage_data
from registry import queries

session.require_login()
session.header("Models & rollouts", "Versions, traffic split and every admin change")

versions = session.safe("model versions (registry)", data.versions_frame)
if versions is not None:
    st.dataframe(versions, hide_index=True, width="stretch", column_config={
        "route_percent": st.column_config.ProgressColumn("traffic %", min_value=0, max_value=100, format="%d %%")})
models = sorted(versions["model"].unique()) if versions is not None and not versions.empty else []
if not models:
    st.info("No model versions are registered yet.")
    st.stop()

model = st.selectbox("Model", models, key="rollout_model")
known = list(versions.loc[versions["model"] == model, "version"])
split = (session.safe("routes (registry)", data.routes) or {}).get(model, {})
st.markdown(f"**Current split of `{model}`:** " + (", ".join(f"v{v}: {p} %" for v, p in sorted(split.items()))
                                                  or "no route"))

if session.is_operator():
    st.subheader("Change the rollout")
    one, full, promote, rollback = st.tabs(["Set a version's percent", "Full split", "Promote", "Roll back"])
    with one:
        version = st.selectbox("Version", known, key="percent_version")
        percent = st.slider("Percent of traffic", 0, 100, int(split.get(version, 0)), key="percent_slider")
        st.caption("The other routed versions share the rest in proportion to their current percents.")
        box = st.container()
        if st.button("Apply percent", key="apply_percent"):
            problems = queries.percent_problems(version, percent, known)
            if problems:
                box.error("Not changed: " + "; ".join(problems))
            else:
                session.write(lambda: session.client().set_percent(model, version, percent),
                              f"{model} v{version} set to {percent} %", box)
    with full:
        cols = st.columns(max(len(known), 1))
        new_split = {v: int(cols[i].number_input(f"v{v} %", value=int(split.get(v, 0)), step=1,
                                                 key=f"split_{model}_{v}")) for i, v in enumerate(known)}
        box = st.container()
        if st.button("Apply split", key="apply_split"):
            problems = queries.split_problems(new_split, known)
            if problems:
                box.error("Not changed: " + "; ".join(problems))
            else:
                session.write(lambda: session.client().set_split(model, new_split), f"{model} split set", box)
    with promote:
        target = st.selectbox("Version to promote to 100 %", known, key="promote_version")
        box = st.container()
        if st.button("Promote…", key="promote"):
            st.session_state["pending"] = ("promote", model, target)
        if st.session_state.get("pending") == ("promote", model, target):
            box.warning(f"Send all traffic of `{model}` to v{target} and mark it serving?")
            c1, c2 = box.columns(2)
            if c1.button("Confirm promote", key="confirm_promote", type="primary"):
                st.session_state.pop("pending", None)
                session.write(lambda: session.client().promote(model, target), f"{model} v{target} promoted", box)
            if c2.button("Cancel", key="cancel_promote"):
                st.session_state.pop("pending", None)
                st.rerun()
    with rollback:
        box = st.container()
        st.caption("Restores the split in force before the last route change of this model.")
        if st.button("Roll back…", key="rollback"):
            st.session_state["pending"] = ("rollback", model)
        if st.session_state.get("pending") == ("rollback", model):
            box.warning(f"Restore the previous split of `{model}`?")
            c1, c2 = box.columns(2)
            if c1.button("Confirm rollback", key="confirm_rollback", type="primary"):
                st.session_state.pop("pending", None)
                session.write(lambda: session.client().rollback(model), f"{model} rolled back", box)
            if c2.button("Cancel", key="cancel_rollback"):
                st.session_state.pop("pending", None)
                st.rerun()

st.subheader("Versions side by side")
window_h = st.select_slider("Window", options=[1, 6, 24, 168], value=24, format_func=lambda h: f"last {h} h",
                            key="compare_window")
comparison = session.safe("latency and errors (usage store)", usage_data.version_comparison, model, window_h * 3600.0)
if comparison is not None:
    if comparison.empty:
        st.info(f"No requests to `{model}` in the last {window_h} h.")
    else:
        st.dataframe(comparison, hide_index=True, width="stretch", column_config={
            "error_rate": st.column_config.NumberColumn("error rate", format="percent"),
            "ttft_ms_p50": st.column_config.NumberColumn("TTFT p50 ms", format="%.0f"),
            "ttft_ms_p95": st.column_config.NumberColumn("TTFT p95 ms", format="%.0f"),
            "duration_ms_p95": st.column_config.NumberColumn("duration p95 ms", format="%.0f"),
            "tokens_per_s_p50": st.column_config.NumberColumn("tokens/s p50", format="%.1f")})
        st.plotly_chart(charts.version_comparison(comparison), width="stretch")

st.subheader("Audit log")
entries = session.safe("the audit log (router)", session.client().audit, 100)
if entries is None:
    entries = session.safe("the audit log (registry)", data.registry_audit, limit=100) or []
st.dataframe(data.audit_frame(entries), hide_index=True, width="stretch")
