"""Capacity: the fleet simulator's day (GPUs per hour, utilisation vs the 60 % target, interactive SLO
attainment, cost) for the policy and settings chosen here."""
import streamlit as st

from admin_ui import capacity, charts, session

session.require_login()
session.header("Capacity", "A simulated day of the production fleet under a scaling policy")

problem = capacity.simulator_problem()
if problem:
    st.error(f"The fleet simulator is not available ({problem}); this page needs autoscale/simulator.")
    st.stop()


@st.cache_data(show_spinner=False, max_entries=16)
def simulate(req: capacity.CapacityRequest) -> capacity.CapacityResult:
    return capacity.run_capacity(req)


workload = capacity.default_workload()
with st.form("capacity"):
    c1, c2, c3, c4 = st.columns(4)
    policies = list(capacity.policies())
    policy = c1.selectbox("Policy", policies, index=policies.index("ours") if "ours" in policies else 0,
                          key="cap_policy")
    horizon = c2.select_slider("Hours simulated", options=[1, 6, 12, 24], value=24, key="cap_horizon")
    step = c3.select_slider("Step (s)", options=[10, 30, 60, 120], value=60, key="cap_step")
    seed = c4.number_input("Seed", value=7, step=1, key="cap_seed")
    c5, c6, c7 = st.columns(3)
    peak = c5.number_input("Peak requests/s", min_value=1.0,
                           value=float(workload.get("peak_requests_per_s", 3500)), step=100.0, key="cap_peak")
    share = c6.slider("Interactive share", 0.0, 1.0, float(workload.get("interactive_share", 0.6)), key="cap_share")
    batch = c7.checkbox("Batch tier enabled", value=True, key="cap_batch")
    run = st.form_submit_button("Simulate")

if run:
    st.session_state["cap_request"] = capacity.CapacityRequest(policy, float(horizon), float(step), int(seed),
                                                               float(peak), float(share), bool(batch))
req = st.session_state.get("cap_request")
if req is None:
    st.info("Choose a policy and settings, then **Simulate** (a day takes a few seconds).")
    st.stop()

with st.spinner(f"simulating {req.horizon_h:.0f} h under policy '{req.policy}'"):
    result = session.safe("the simulation", simulate, req)
if result is None:
    st.stop()
s = result.summary
m = st.columns(5)
m[0].metric("peak GPUs", f"{s['peak_gpus_allocated']:,}")
m[1].metric("GPU-hours", f"{s['gpu_hours']:,.0f}")
m[2].metric("utilisation (day)", f"{s['daily_avg_utilisation']:.1%}",
            delta=f"{s['daily_avg_utilisation'] - capacity.UTILISATION_TARGET:+.1%} vs 60 % target")
m[3].metric("interactive SLO met", f"{s['interactive_slo_attainment']:.2%}")
m[4].metric(f"cost ({session.currency()})", f"{s['cost_usd']:,.0f}")
left, right = st.columns(2)
left.plotly_chart(charts.capacity_day(result.hourly), width="stretch")
right.plotly_chart(charts.capacity_quality(result.hourly, capacity.UTILISATION_TARGET), width="stretch")
st.plotly_chart(charts.capacity_cost(result.hourly), width="stretch")
with st.expander("Per hour and per pool"):
    st.dataframe(result.hourly, hide_index=True, width="stretch")
    st.dataframe(result.pools, hide_index=True, width="stretch")
