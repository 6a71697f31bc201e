"""Models & rollouts: versions with status and build info, the traffic split; operators change it with only
the allowed choices and a preview of old -> new to confirm; promote / roll back (confirmed); automatic
rollback rules; the versions side by side over time; the audit log."""
import pandas as pd
import streamlit as st

from admin_ui import charts, charts_history, data, session, url_state, usage_data
from registry import queries

WINDOWS_H = {"1 h": 1, "6 h": 6, "24 h": 24, "7 d": 168}

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

model = st.selectbox("Model", models, key="rollout_model", index=models.index(url_state.initial("model", models[0],
                                                                                                  models)))
url_state.publish(model=model)
routable = data.routable_versions(versions, model)
split = (session.safe("routes (registry)", data.routes) or {}).get(model, {})
st.markdown(f"**Current split of `{model}`:** " + (", ".join(f"v{v}: {p} %" for v, p in sorted(split.items()))
                                                  or "no route"))
status = session.safe("rollout readiness (router)", session.client().rollout, model) if split else None
if status is not None:
    st.markdown("**Traffic now:** " + "; ".join(status["rollout"]["notes"]))


def confirm(key: str, question: str, box, action, done: str) -> None:
    """Show `question` with Confirm / Cancel while `key` is pending; Confirm runs the write."""
    if st.session_state.get("pending") != key:
        return
    box.warning(question)
    yes, no = box.columns(2)
    if yes.button("Confirm", key=f"confirm_{key[0]}", type="primary"):
        st.session_state.pop("pending", None)
        session.write(action, done, box)
    if no.button("Cancel", key=f"cancel_{key[0]}"):
        st.session_state.pop("pending", None)
        st.rerun()


def preview(new: dict[str, int], box) -> None:
    box.dataframe(data.split_preview_frame(split, new), hide_index=True, width=360)


if session.is_operator():
    st.subheader("Change the rollout")
    one, full, promote, rollback, rule = st.tabs(["Set a version's percent", "Full split", "Promote", "Roll back",
                                                  "Automatic rollback"])
    with one:
        if len(routable) < 2:
            st.info(f"Only {', '.join('v' + v for v in routable) or 'no version'} of `{model}` can take traffic "
                    f"(staged, serving or draining), so there is no split to change. Stage another version first.")
        else:
            version = st.selectbox("Version", routable, key="percent_version")
            percent = st.slider("Percent of traffic", 0, 100, int(split.get(version, 0)), step=1, key="percent_slider")
            st.caption("The other routed versions share the rest in proportion to their current percents.")
            override = st.text_input("Override the quality gate (reason, audited)", key="gate_override",
                                     max_chars=500, help="Only needed to ramp a version without a passed quality "
                                     "gate past the router's gated percentage; the reason lands in the audit log.")
            box = st.container()
            new, problem = data.preview_split(split, version, percent)
            if new is None:
                box.error(f"Not possible: {problem}")
            elif new == split:
                box.info("This is the current split; nothing to apply.")
            else:
                preview(new, box)
                if box.button("Apply percent…", key="apply_percent"):
                    st.session_state["pending"] = ("percent", model, version, percent)
                confirm(("percent", model, version, percent), f"Route `{model}` as shown above?"
                        + (" The quality-gate override will be audited." if override.strip() else ""), box,
                        lambda: session.client().set_percent(model, version, percent, override.strip()),
                        f"{model} v{version} set to {percent} %")
    with full:
        if len(routable) < 2:
            st.info("A split needs at least two versions that can take traffic.")
        else:
            cols = st.columns(len(routable))
            new_split = {v: int(cols[i].number_input(f"v{v} %", min_value=0, max_value=100, step=1,
                                                     value=int(split.get(v, 0)), key=f"split_{model}_{v}"))
                         for i, v in enumerate(routable)}
            box = st.container()
            problems = queries.split_problems(new_split, routable)
            new = {v: p for v, p in new_split.items() if p}
            if problems:
                box.error("Not possible: " + "; ".join(problems))
            elif new == split:
                box.info("This is the current split; nothing to apply.")
            else:
                preview(new, box)
                if box.button("Apply split…", key="apply_split"):
                    st.session_state["pending"] = ("split", model, tuple(sorted(new.items())))
                confirm(("split", model, tuple(sorted(new.items()))), f"Route `{model}` as shown above?", box,
                        lambda: session.client().set_split(model, new), f"{model} split set")
    with promote:
        target = st.selectbox("Version to promote to 100 %", routable, key="promote_version")
        box = st.container()
        if target and split == {target: 100}:
            box.info(f"v{target} already takes all traffic.")
        elif target:
            preview({target: 100}, box)
            if box.button("Promote…", key="promote"):
                st.session_state["pending"] = ("promote", model, target)
            confirm(("promote", model, target), f"Send all traffic of `{model}` to v{target} and mark it serving?",
                    box, lambda: session.client().promote(model, target), f"{model} v{target} promoted")
    with rollback:
        box = st.container()
        st.caption("Restores the split in force before the last route change of this model.")
        if st.button("Roll back…", key="rollback"):
            st.session_state["pending"] = ("rollback", model)
        confirm(("rollback", model), f"Restore the previous split of `{model}`?", box,
                lambda: session.client().rollback(model), f"{model} rolled back")
    with rule:
        st.caption("Routes a version to 0 % when its error rate or TTFT p95 stays above the limit in each of N "
                   "consecutive minutes (a minute without requests resets the count). Evaluated once a minute by "
                   "the metrics scraper; a firing is audited as `auto_rollback` and disarms the rule.")
        with st.form("rule_form"):
            r = st.columns(5)
            rule_version = r[0].selectbox("Version to watch", routable, key="rule_version")
            max_err = r[1].number_input("Max error rate (%)", min_value=0.0, max_value=99.9, value=5.0, step=0.5,
                                        key="rule_error")
            max_ttft = r[2].number_input("Max TTFT p95 (ms, 0 = no limit)", min_value=0, max_value=600_000,
                                         value=2000, step=100, key="rule_ttft")
            minutes = r[3].number_input("For N minutes", min_value=1, max_value=120, value=3, step=1,
                                        key="rule_minutes")
            armed = r[4].toggle("Armed", value=True, key="rule_armed")
            saved = st.form_submit_button("Save rule")
        box = st.container()
        if saved and rule_version:
            body = {"max_error_rate": max_err / 100, "max_ttft_ms_p95": float(max_ttft) or None,
                    "minutes": int(minutes), "armed": bool(armed)}
            session.write(lambda: session.client().set_rollback_rule(model, rule_version, body),
                          f"rollback rule for {model} v{rule_version} saved", box)

rules = session.safe("rollback rules (router)", session.client().rollback_rules)
if rules:
    st.markdown("**Automatic rollback rules**")
    frame = pd.DataFrame(rules)
    st.dataframe(frame[frame["model"] == model], hide_index=True, width="stretch", column_order=[
        "version", "armed", "max_error_rate", "max_ttft_ms_p95", "minutes", "armed_by", "armed_at", "fired_at",
        "fired_reason"], column_config={"max_error_rate": st.column_config.NumberColumn("max error rate",
                                                                                         format="percent")})

st.subheader("Quality gate, version by version")
gates = session.safe("quality gate reports (registry)", data.quality_gate_frame, model)
gate_percent = (status or {}).get("quality_gate", {}).get("gate_percent")
st.caption("Each version's build-time gate: our engine vs the checkpoint's transformers fp32 run on the shipped "
           "evaluation set (greedy agreement, |logprob delta|, perplexity). "
           + (f"A version takes more than {gate_percent} % of traffic only with a passed gate (an operator "
              "override is audited)." if gate_percent is not None else ""))
if gates is not None:
    st.dataframe(gates, hide_index=True, width="stretch", column_config={
        "route_percent": st.column_config.ProgressColumn("traffic %", min_value=0, max_value=100, format="%d %%"),
        "agreement": st.column_config.NumberColumn("agreement", format="%.3f")})

st.subheader("Versions side by side")
w1, w2 = st.columns([2, 5])
window_key = w1.segmented_control("Window", list(WINDOWS_H), key="compare_window",
                                  default=url_state.initial("window", "24 h", list(WINDOWS_H))) or "24 h"
url_state.publish(window=window_key)
window_h = WINDOWS_H[window_key]
comparison = session.safe("latency and errors (usage store)", usage_data.version_comparison, model, window_h * 3600.0)
if comparison is not None:
    if comparison.empty:
        st.info(f"No requests to `{model}` in the last {window_key}.")
    else:
        bucket_s = {1: 60, 6: 300, 24: 900, 168: 3600}[window_h]
        series = session.safe("versions over time (usage store)", usage_data.version_series, model,
                              window_h * 3600.0, bucket_s)
        if series is not None and not series.empty:
            end = pd.Timestamp.now(tz="UTC")
            st.plotly_chart(charts_history.version_panels(series, (end - pd.Timedelta(hours=window_h), end)),
                            width="stretch")
            st.caption(f"Each point covers {bucket_s // 60} min of finished requests (usage store).")
        left, right = st.columns([3, 2])
        left.dataframe(comparison, hide_index=True, width="stretch", column_config={
            "error_rate": st.column_config.NumberColumn("error rate", format="percent"),
            "ttft_ms_p50": st.column_config.NumberColumn("TTFT p50 ms", format="%.0f"),
            "ttft_ms_p95": st.column_config.NumberColumn("TTFT p95 ms", format="%.0f"),
            "duration_ms_p95": st.column_config.NumberColumn("duration p95 ms", format="%.0f"),
            "tokens_per_s_p50": st.column_config.NumberColumn("tokens/s p50", format="%.1f")})
        right.plotly_chart(charts.version_comparison(comparison), width="stretch")

st.subheader("Audit log")
entries = session.safe("the audit log (router)", session.client().audit, 100)
if entries is None:
    entries = session.safe("the audit log (registry)", data.registry_audit, limit=100) or []
st.dataframe(data.audit_frame(entries), hide_index=True, width="stretch",
             column_config={"before": st.column_config.TextColumn(width="medium"),
                            "after": st.column_config.TextColumn(width="medium")})
