"""Chargeback: tokens by team over time (prefill / cached / decode), cost by team, model and adapter with
the prices used, top callers; date range and team filters; CSV download."""
import datetime as dt

import streamlit as st

from admin_ui import charts, session, usage_data

ALL_TEAMS = "(all teams)"

session.require_login()
session.header("Chargeback", "Token usage and cost per team from the usage store")

bounds = session.safe("the usage date range (usage store)", usage_data.date_bounds)
today = dt.datetime.now(dt.timezone.utc).date()
first, last = bounds if bounds else (today - dt.timedelta(days=30), today)
c1, c2, c3 = st.columns([2, 2, 1])
picked = c1.date_input("Date range (UTC, inclusive)", value=(first, last), key="cb_dates")
teams = session.safe("teams (usage store)", usage_data.teams) or []
team_pick = c2.selectbox("Team", [ALL_TEAMS, *teams], key="cb_team")
granularity = c3.radio("Per", ["day", "hour"], horizontal=True, key="cb_granularity")
since, until = (picked[0], picked[1]) if isinstance(picked, tuple) and len(picked) == 2 else (picked, picked)
if isinstance(since, tuple):  # a half-chosen range: one day
    since = until = since[0] if since else first
team = None if team_pick == ALL_TEAMS else team_pick

if bounds is None and teams == []:
    st.info("The usage store holds no requests yet.")

tokens = session.safe("tokens over time (usage store)", usage_data.tokens_over_time, since, until, team, granularity)
if tokens is not None and not tokens.empty:
    st.plotly_chart(charts.tokens_stacked(tokens), width="stretch")

st.subheader("Cost by team, model and adapter")
costs = session.safe("the cost table (usage store)", usage_data.cost_table, since, until, team)
if costs is not None:
    if costs.empty:
        st.info("No usage in this range.")
    else:
        total = costs["cost_total"].sum()
        m1, m2, m3 = st.columns(3)
        m1.metric("cost (price units)", f"{total:,.6f}")
        m2.metric("requests", f"{int(costs['requests'].sum()):,}")
        m3.metric("tokens", f"{int(costs[['prefill_tokens', 'cached_tokens', 'decode_tokens']].sum().sum()):,}")
        st.dataframe(costs, hide_index=True, width="stretch")
    st.download_button("Download CSV", costs.to_csv(index=False).encode(), key="cb_csv", mime="text/csv",
                       file_name=f"chargeback_{since}_{until}{'_' + team if team else ''}.csv")

left, right = st.columns(2)
with left:
    st.subheader("Prices used (per 1M tokens)")
    prices = session.safe("prices (usage store)", usage_data.prices)
    if prices is not None:
        st.dataframe(prices, hide_index=True, width="stretch")
        st.caption('The "\\*" row prices every model that has no row of its own.')
with right:
    st.subheader("Top callers")
    top = session.safe("top callers (usage store)", usage_data.top_callers, since, until, team)
    if top is not None:
        st.dataframe(top[["caller", "team", "requests", "cost_total"]] if not top.empty else top,
                     hide_index=True, width="stretch")
