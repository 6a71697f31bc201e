"""Plotly figures over time for the admin UI: cost by team, budgets, fleet history, versions side by side,
warm buffers and autoscaler decisions. Every time axis is a real date axis (empty stretches stay visible)."""
from __future__ import annotations

import datetime as dt

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from admin_ui.charts import _LAYOUT

STATUS_COLOURS = {"on track": "#54a24b", "will overrun": "#f58518", "over budget": "#e45756", "no budget": "#9d9da1"}


def cost_over_time(frame: pd.DataFrame, since: dt.date, until: dt.date, currency: str) -> go.Figure:
    """Daily cost stacked by team on a continuous date axis covering the whole range."""
    fig = px.bar(frame, x="day", y="cost_total", color="team", labels={"cost_total": currency, "day": ""})
    fig.update_xaxes(type="date", range=[pd.Timestamp(since) - pd.Timedelta(hours=12),
                                         pd.Timestamp(until) + pd.Timedelta(hours=12)], tickformat="%b %d")
    fig.update_layout(title=f"Cost per day by team ({currency})", barmode="stack", yaxis_title=currency, **_LAYOUT)
    return fig


def budgets(status: pd.DataFrame, currency: str) -> go.Figure:
    """Month to date and forecast against the budget, per team."""
    fig = go.Figure()
    fig.add_bar(x=status["team"], y=status["month_to_date"], name="month to date",
                marker_color=[STATUS_COLOURS.get(s, "#4c78a8") for s in status["status"]])
    fig.add_scatter(x=status["team"], y=status["forecast_month_end"], name="forecast month end", mode="markers",
                    marker=dict(symbol="diamond", size=12, color="#333"))
    with_budget = status.dropna(subset=["budget"])
    fig.add_scatter(x=with_budget["team"], y=with_budget["budget"], name="budget", mode="markers",
                    marker=dict(symbol="line-ew", size=60, line=dict(width=3, color="#e45756")))
    fig.update_layout(title=f"Actual vs budget ({currency})", yaxis_title=currency,
                      **{**_LAYOUT, "legend": dict(orientation="h", yanchor="top", y=-0.12, xanchor="left", x=0)})
    return fig


def lines(frame: pd.DataFrame, y: str, title: str, y_title: str, colour: str | None = None,
          x_range: tuple | None = None, percent: bool = False) -> go.Figure:
    """One line per `colour` group over `ts` (epoch seconds, drawn as UTC times)."""
    f = frame.assign(time=pd.to_datetime(frame["ts"], unit="s", utc=True))
    fig = px.line(f, x="time", y=y, color=colour, markers=len(f) < 60, labels={y: y_title, "time": ""})
    fig.update_xaxes(type="date", range=x_range)
    if percent:  # shares: from 0, at least 0..5 %, at most 0..100 %
        top = float(pd.to_numeric(f[y], errors="coerce").max() or 0)
        fig.update_yaxes(range=[0, min(1.0, max(0.05, top * 1.2))], tickformat=".0%")
    else:
        fig.update_yaxes(rangemode="tozero")
    fig.update_layout(title=title, yaxis_title=y_title, **_LAYOUT)
    return fig


def version_panels(frame: pd.DataFrame, x_range: tuple | None = None) -> go.Figure:
    """Per-version TTFT p95, error rate and tokens/s per time bucket, in three panels side by side."""
    long = frame.melt(id_vars=["bucket", "version"], value_vars=["ttft_ms_p95", "error_rate", "tokens_per_s_p50"],
                      var_name="metric", value_name="value")
    names = {"ttft_ms_p95": "TTFT p95 (ms)", "error_rate": "error rate", "tokens_per_s_p50": "tokens/s per stream"}
    long["metric"] = long["metric"].map(names)
    fig = px.line(long, x="bucket", y="value", color="version", facet_col="metric", markers=True,
                  category_orders={"metric": list(names.values())},
                  labels={"bucket": "", "value": "", "version": "version"})
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    fig.update_xaxes(type="date", range=x_range, nticks=5)
    fig.update_yaxes(matches=None, rangemode="tozero", showticklabels=True)
    fig.update_layout(title="Versions side by side over time", **_LAYOUT)
    return fig


def buffer_timeline(decisions: pd.DataFrame) -> go.Figure:
    """Serving / starting / desired replicas per pool at each autoscaler decision, with the signals in the hover."""
    fig = go.Figure()
    for pool, f in decisions.sort_values("at").groupby("pool"):
        for col, dash in (("serving", "solid"), ("desired", "dash"), ("starting", "dot")):
            fig.add_scatter(x=f["at"], y=f[col], name=f"{pool} {col}", mode="lines+markers", line_shape="hv",
                            line=dict(dash=dash), customdata=f[["why"]], hovertemplate="%{y}<br>%{customdata[0]}")
    fig.update_yaxes(rangemode="tozero", tickformat="d", title="replicas")
    fig.update_layout(title="Autoscaler decisions (hover: the signals behind each)", **_LAYOUT)
    return fig


def signal_timeline(decisions: pd.DataFrame) -> go.Figure:
    """The signals each decision was made on (one line per signal, per pool)."""
    f = decisions.dropna(subset=["signal_value"]) if "signal_value" in decisions else decisions.iloc[0:0]
    fig = px.line(f, x="at", y="signal_value", color="signal", line_dash="pool", markers=True,
                  labels={"at": "", "signal_value": ""})
    fig.update_layout(title="Signals behind the decisions", **_LAYOUT)
    return fig
