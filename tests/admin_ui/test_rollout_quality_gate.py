"""Models & rollouts page, quality before ramping: the versions' gate reports side by side (the serving
version's next to the candidate's), and the router's refusal shown when a candidate without a passed gate is
ramped past the gated percentage."""
from __future__ import annotations

from registry import queries
from registry.db import session_scope
from tests.admin_ui.gate_reports import gate_report
from tests.admin_ui.stack import MODEL


def test_gate_reports_side_by_side_and_refusal_shown(stack, page):
    with session_scope(stack.db_url) as s:
        queries.upsert_model_version(s, MODEL, "2", quality_gate=gate_report(0.6))
    at = page("rollouts")
    assert not at.exception
    gates = next(d.value for d in at.dataframe if "gate" in d.value.columns).set_index("version")
    assert gates.loc["1", "gate"] == "passed" and gates.loc["1", "agreement"] == 0.97
    assert gates.loc["2", "gate"] == "FAILED" and "greedy agreement 0.6000 < 0.9" in gates.loc["2", "why"]
    assert "only with a passed gate" in " ".join(c.value for c in at.caption)
    at.selectbox(key="percent_version").select("2").run()
    at.slider(key="percent_slider").set_value(30).run()
    at.button(key="apply_percent").click().run()
    at.button(key="confirm_percent").click().run()
    assert "no passed quality gate" in " | ".join(e.value for e in at.error)
    with session_scope(stack.db_url) as s:
        assert queries.routes_for(s, MODEL) == {"1": 100}
    reason = "INC-12: gate failed on a tokenizer change, offline evals fine"
    at.text_input(key="gate_override").input(reason).run()
    at.button(key="apply_percent").click().run()
    at.button(key="confirm_percent").click().run()
    assert not at.exception
    with session_scope(stack.db_url) as s:
        assert queries.routes_for(s, MODEL) == {"1": 70, "2": 30}
        override = next(a for a in queries.list_audit(s) if a.action == "quality_gate_override")
    assert override.actor == "alice" and override.after["reason"] == reason
