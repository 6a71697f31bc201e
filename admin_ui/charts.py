"""Plotly figures for the admin UI pages (built from the frames of data.py, usage_data.py, capacity.py)."""
from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

KIND_COLOURS = {"prefill": "#4c78a8", "cached": "#72b7b2", "decode": "#f58518"}
_LAYOUT = dict(margin=dict(l=10, r=10, t=70, b=10), height=340, legend_title_text="",
               legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0))


def _count_axis(values: pd.Series, **extra) -> dict:
    """A right-hand axis for small whole counts (queue lengths): integer ticks, from zero."""
    top = float(pd.to_numeric(values, errors="coerce").fillna(0).max() or 0)
    return dict(overlaying="y", side="right", rangemode="tozero", tickformat="d", tickmode="linear",
                dtick=max(1, int(top // 4) or 1), showgrid=False, **extra)


def ttft_vs_slo(frame: pd.DataFrame) -> go.Figure:
    """TTFT p95 per replica as bars, the tier SLO as a marker line."""
    f = frame.dropna(subset=["ttft_ms_p95"])
    fig = go.Figure()
    colours = ["#54a24b" if ok else "#e45756" for ok in f["meets_slo"]]
    fig.add_bar(x=f["replica_id"], y=f["ttft_ms_p95"], name="TTFT p95 (ms)", marker_color=colours)
    fig.add_scatter(x=f["replica_id"], y=f["slo_ttft_ms_p95"], name="SLO (ms)", mode="markers",
                    marker=dict(symbol="line-ew", size=70, line=dict(width=3, color="#333")))
    fig.update_layout(title="TTFT p95 against the tier SLO", yaxis_title="ms", **_LAYOUT)
    return fig


def kv_and_queue(frame: pd.DataFrame) -> go.Figure:
    """KV-cache utilisation (%) and queue length per replica."""
    f = frame[frame["reporting"]]
    fig = go.Figure()
    fig.add_bar(x=f["replica_id"], y=(f["kv_utilisation"] * 100).round(1), name="KV used (%)", offsetgroup="kv")
    fig.add_bar(x=f["replica_id"], y=f["waiting"], name="waiting requests", yaxis="y2", offsetgroup="queue")
    fig.update_layout(title="KV utilisation and queue", barmode="group", yaxis=dict(title="%", range=[0, 100]),
                      yaxis2=_count_axis(f["waiting"], title="waiting"), **_LAYOUT)
    return fig


def version_comparison(frame: pd.DataFrame) -> go.Figure:
    """Side-by-side TTFT p50/p95 and error rate per version."""
    fig = go.Figure()
    versions = frame["version"].astype(str)
    fig.add_bar(x=versions, y=frame["ttft_ms_p50"], name="TTFT p50 (ms)")
    fig.add_bar(x=versions, y=frame["ttft_ms_p95"], name="TTFT p95 (ms)")
    errors_pct = frame["error_rate"].fillna(0) * 100
    fig.add_scatter(x=versions, y=errors_pct, name="errors (%)", yaxis="y2", mode="markers",
                    marker=dict(size=14, symbol="diamond", color="#e45756"))
    fig.update_layout(title="Versions under rollout: latency and errors", barmode="group",
                      xaxis=dict(title="version", type="category"), yaxis=dict(title="ms"),
                      yaxis2=dict(title="errors %", overlaying="y", side="right", showgrid=False, tickmode="auto",
                                  nticks=6, range=[0, max(5.0, float(errors_pct.max()) * 1.2)]),
                      **{**_LAYOUT, "legend": dict(orientation="h", yanchor="top", y=-0.2, xanchor="left", x=0)})
    return fig


def tokens_stacked(long: pd.DataFrame) -> go.Figure:
    """Tokens per period stacked by kind, one panel per team."""
    long = long.assign(period=long["period"].astype(str).str.removesuffix(" 00:00:00"))
    fig = px.bar(long, x="period", y="tokens", color="kind", facet_col="team", facet_col_wrap=3,
                 color_discrete_map=KIND_COLOURS, category_orders={"kind": list(KIND_COLOURS)})
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    fig.update_xaxes(type="category", title_text="")
    fig.update_layout(title="Tokens by team (prefill / cached / decode)", **{
        **_LAYOUT, "legend": dict(orientation="v", yanchor="top", y=1, xanchor="left", x=1.01)})
    return fig


def capacity_day(hourly: pd.DataFrame) -> go.Figure:
    """GPUs allocated and busy per hour."""
    fig = go.Figure()
    fig.add_scatter(x=hourly["hour"], y=hourly["gpus_allocated"], name="GPUs allocated", mode="lines",
                    line_shape="hv")
    fig.add_scatter(x=hourly["hour"], y=hourly["gpus_busy"], name="GPUs busy", mode="lines", fill="tozeroy")
    fig.update_layout(title="GPUs needed per hour", xaxis_title="hour of the simulated day", yaxis_title="GPUs",
                      **_LAYOUT)
    return fig


def capacity_quality(hourly: pd.DataFrame, target: float) -> go.Figure:
    """Utilisation against the target and interactive SLO attainment per hour (both in %)."""
    fig = go.Figure()
    fig.add_scatter(x=hourly["hour"], y=hourly["utilisation"] * 100, name="GPU utilisation (%)", mode="lines+markers")
    fig.add_scatter(x=hourly["hour"], y=hourly["slo_attainment"] * 100, name="interactive SLO attained (%)",
                    mode="lines+markers")
    fig.add_hline(y=target * 100, line_dash="dash", line_color="#333",
                  annotation_text=f"{target:.0%} utilisation target")
    fig.update_layout(title="Utilisation and SLO attainment", xaxis_title="hour", yaxis=dict(title="%", range=[0, 105]),
                      **_LAYOUT)
    return fig


def capacity_cost(hourly: pd.DataFrame) -> go.Figure:
    fig = px.bar(hourly, x="hour", y="cost_usd")
    fig.update_layout(title="GPU cost per hour (USD)", xaxis_title="hour", yaxis_title="USD", **_LAYOUT)
    return fig
