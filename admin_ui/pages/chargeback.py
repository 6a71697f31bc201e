"""Chargeback, as finance reads it in FinOps tools: cost over time stacked by team (month to date by default),
filters for team, model, version, adapter, tier and caller (kept in the URL), unit cost per 1M tokens,
monthly budgets per team with a month-end forecast and overrun warnings, each API key's own budget against
the routers' spend (operators set and remove both kinds), GPU-hours with the idle share,
and the line items as CSV or Parquet. One currency everywhere (FLEET_CURRENCY)."""
import datetime as dt

import streamlit as st

from admin_ui import budget_form, charts_history, chargeback_data as cd, session, url_state, usage_data

ALL = "(all)"
session.require_login()
session.header("Chargeback", "Cost per team from the usage store, priced per token kind")
currency = session.currency()
now = dt.datetime.now(dt.timezone.utc)
first, last = cd.month_to_date(now.date())

c = st.columns([2.2, 1, 1, 1, 1, 1, 1])
picked = c[0].date_input("Days (UTC, inclusive)", key="cb_dates",
                         value=(url_state.initial_date("since", first), url_state.initial_date("until", last)))
since, until = (picked[0], picked[-1]) if isinstance(picked, tuple) and picked else (first, last)
choices = session.safe("filter values (usage store)", cd.options, since, until) or {d: [] for d in cd.FILTER_DIMENSIONS}
equal = {}
for col, dim in zip(c[1:], cd.FILTER_DIMENSIONS):
    values = [ALL, *choices[dim]]
    start = url_state.initial(dim, ALL, values)
    pick = col.selectbox(dim.capitalize(), values, index=values.index(start), key=f"cb_{dim}",
                         format_func=lambda v, d=dim: "(base model)" if d == "adapter" and v == "" else v)
    if pick != ALL:
        equal[dim] = pick
url_state.publish(since=since, until=until, **{d: equal.get(d) for d in cd.FILTER_DIMENSIONS if d != "adapter"},
                  adapter=None if "adapter" not in equal else (equal["adapter"] or None))
filters = cd.Filters(since, until, equal)

totals = session.safe("the cost table (usage store)", cd.cost, filters, ())
if totals is not None:
    total = float(totals["cost_total"].sum()) if not totals.empty else 0.0
    tokens = int(totals[cd.TOKEN_COLUMNS].sum().sum()) if not totals.empty else 0
    m = st.columns(4)
    m[0].metric(f"cost ({currency})", f"{total:,.6f}")
    m[1].metric("requests", f"{int(totals['requests'].sum()) if not totals.empty else 0:,}")
    m[2].metric("tokens", f"{tokens:,}")
    m[3].metric(f"unit cost ({currency} / 1M tokens)", f"{total / tokens * 1e6:,.4f}" if tokens else "–")
    if totals.empty:
        st.info(f"No usage from {since} to {until} for these filters.")

over_time = session.safe("cost over time (usage store)", cd.cost_over_time, filters)
if over_time is not None and not over_time.empty:
    st.plotly_chart(charts_history.cost_over_time(over_time, since, until, currency), width="stretch")

st.subheader(f"Budgets this month ({now:%B %Y}, UTC)")
status = session.safe("budgets (registry) and month-to-date cost", cd.budget_status, now, currency)
if status is not None:
    for row in status.itertuples():
        if row.status == "over budget":
            st.error(f"**{row.team}** is over budget: {cd.money(row.month_to_date)} of {cd.money(row.budget)} "
                     f"{currency} spent; forecast {cd.money(row.forecast_month_end)} {currency} by month end.")
        elif row.status == "will overrun":
            st.warning(f"**{row.team}** will overrun its budget: forecast {cd.money(row.forecast_month_end)} "
                       f"{currency} by month end against {cd.money(row.budget)} {currency} "
                       f"({cd.money(row.month_to_date)} spent so far).")
    left, right = st.columns([3, 2])
    left.dataframe(status, hide_index=True, width="stretch", column_config={
        "month_to_date": st.column_config.NumberColumn(f"month to date ({currency})", format="%.6f"),
        "forecast_month_end": st.column_config.NumberColumn(f"forecast month end ({currency})", format="%.6f"),
        "budget": st.column_config.NumberColumn(f"budget ({currency})", format="%.6f"),
        "used_share": st.column_config.ProgressColumn("budget used", min_value=0.0, max_value=1.0,
                                                      format="percent"),
        "routers_spent": st.column_config.NumberColumn("routers' spend this period", format="%.6f"),
        "routers_reserved": st.column_config.NumberColumn("reserved in flight", format="%.6f")})
    if not status.empty:
        right.plotly_chart(charts_history.budgets(status, currency), width="stretch")
    st.caption("Forecast = month-to-date cost at the month-to-date run rate, extended to the month's end. "
               "Routers' spend: what the routers settled against the budget this period (the same prices; "
               "requests over an enforced budget are refused), and what requests in flight reserve.")
    if session.is_operator():
        budget_form.editor(budget_form.TEAM, sorted(set(status["team"]) | set(choices["team"])),
                           sorted(status.loc[status["budget"].notna(), "team"]), currency)

st.subheader("Budgets per API key")
keys = session.safe("key budgets (registry)", cd.key_budget_status, currency)
if keys is not None:
    for row in keys[keys["status"].str.startswith("over budget")].itertuples():
        st.error(f"Key **{row.caller}** (team {row.team}) is over budget: {row.spent + row.reserved:,.6g} of "
                 f"{row.budget:,.6g} {row.unit} used or reserved this {row.period} ({row.current_period}); "
                 + ("its requests are refused." if row.enforce else "not enforced."))
    if keys.empty:
        st.info("No API key has a budget of its own; each is limited by its team's budget only.")
    else:
        st.dataframe(keys, hide_index=True, width="stretch", column_order=[
            "caller", "team", "status", "used_share", "budget", "unit", "period", "spent", "reserved", "current_period",
            "soft_share", "enforce"], column_config={
            "budget": st.column_config.NumberColumn("budget per period", format="%.6g"),
            "unit": st.column_config.TextColumn("unit", help=f"{currency} or tokens"),
            "spent": st.column_config.NumberColumn("routers' spend this period", format="%.6g"),
            "reserved": st.column_config.NumberColumn("reserved in flight", format="%.6g"),
            "used_share": st.column_config.ProgressColumn("budget used", min_value=0.0, max_value=1.0,
                                                          format="percent"),
            "soft_share": st.column_config.NumberColumn("warn at", format="percent")})
    st.caption("A key's own budget is enforced besides its team's, by the same rule: a request is refused when "
               "the routers' spend this period + what requests in flight reserve + its worst case (prompt + "
               "max_tokens, priced at the model's rates) passes the budget. These are the routers' numbers.")
    if session.is_operator():
        owners = session.safe("callers (registry)", cd.callers) or {}
        budget_form.editor(budget_form.KEY, list(owners), list(keys["caller"]), currency,
                           describe=lambda name: f"{name} (team {owners.get(name, '?')})")

st.subheader("Cost by team, model, version, adapter and tier")
breakdown = session.safe("the cost breakdown (usage store)", cd.cost, filters,
                         ("team", "model", "version", "adapter", "tier"))
if breakdown is not None and not breakdown.empty:
    st.dataframe(breakdown, hide_index=True, width="stretch", column_order=[
        "team", "model", "version", "adapter", "tier", "cost_total", "requests", "prefill_tokens", "cached_tokens",
        "decode_tokens", "cost_prefill", "cost_cached", "cost_decode", "errors"], column_config={
        c: st.column_config.NumberColumn(f"{c.removeprefix('cost_')} ({currency})" if c != "cost_total"
                                         else f"cost ({currency})", format="%.6f")
        for c in ("cost_total", "cost_prefill", "cost_cached", "cost_decode")})

left, right = st.columns(2)
with left:
    st.subheader("Unit cost per 1M tokens")
    units = session.safe("unit costs (usage store)", cd.unit_costs, filters)
    if units is not None:
        st.dataframe(units, hide_index=True, width="stretch", column_config={
            "cost_total": st.column_config.NumberColumn(f"cost ({currency})", format="%.6f"),
            "cost_per_1m_tokens": st.column_config.NumberColumn(f"{currency} / 1M tokens", format="%.4f")})
with right:
    st.subheader("GPU-hours by team")
    hours = session.safe("GPU-hours (usage store)", cd.gpu_hours, filters)
    if hours is not None:
        if hours.empty:
            st.info("No GPU-hours recorded for these days (`fleet usage gpu-hours` or the autoscaler record them).")
        else:
            idle = float(hours.loc[hours["team"] == "(idle)", "share"].sum())
            st.caption(f"Idle share: **{idle:.1%}** of the fleet's GPU-hours had no traffic (team `(idle)`). "
                       "GPU-hours follow the days and team filters only.")
            st.dataframe(hours, hide_index=True, width="stretch", column_config={
                "share": st.column_config.ProgressColumn("share", min_value=0.0, max_value=1.0, format="percent"),
                "gpu_hours": st.column_config.NumberColumn("GPU-hours", format="%.3f")})

with st.expander(f"Prices used ({currency} per 1M tokens)"):
    prices = session.safe("prices (usage store)", usage_data.prices)
    if prices is not None:
        st.dataframe(prices, hide_index=True, width="stretch")
        st.caption('The "\\*" row prices every model without a row of its own; set with `fleet usage prices --set`.')

st.subheader("Export")
lines = session.safe("line items (usage store)", cd.export_frame, filters, currency)
if lines is not None:
    name = f"chargeback_{since}_{until}"
    e = st.columns([1, 1, 4])
    e[0].download_button("Download CSV", cd.to_csv(lines), file_name=f"{name}.csv", mime="text/csv", key="cb_csv")
    e[1].download_button("Download Parquet", cd.to_parquet(lines), file_name=f"{name}.parquet",
                         mime="application/vnd.apache.parquet", key="cb_parquet")
    e[2].caption(f"{len(lines)} line items: one per day, team, caller, model, version, adapter and tier; "
                 f"columns period, tier and currency ({currency}); money with 6 plain decimals.")
