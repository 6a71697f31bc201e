"""The budget editor operators get on the chargeback page, one implementation for both kinds of budget: a team's
and one API key's (caller's) own, enforced besides its team's. Both write through the router's admin API
(`PUT/DELETE /admin/budgets/{team}`, `PUT/DELETE /admin/callers/{name}/budget`), which validates again and
audits (set_budget / set_key_budget / delete_...); the input is checked here first so a mistake is shown under
the field it is in, with what is allowed."""
from __future__ import annotations

from dataclasses import dataclass

import streamlit as st

from admin_ui import chargeback_data as cd, session


@dataclass(frozen=True)
class Kind:
    scope: str         # the admin API's: "team" | "key"
    owner_label: str   # the owner field's label
    prefix: str        # widget keys: f"{prefix}_amount" etc.
    owner_key: str     # the owner field's widget key
    set_label: str     # the submit buttons
    remove_label: str


TEAM = Kind("team", "Team", "budget", "budget_team", "Set budget", "Remove budget")
KEY = Kind("key", "Caller (API key)", "key_budget", "key_budget_caller", "Set key budget", "Remove key budget")


def editor(kind: Kind, owners: list[str], budgeted: list[str], currency: str,
           describe=lambda owner: owner) -> None:
    """The set form (owner, amount per period in money or tokens, period, unit, warn share, enforce) and, when
    some owner has a budget, the remove form. `describe` labels an owner in the choice (e.g. its team)."""
    with st.form(f"{kind.prefix}_form"):
        c = st.columns([2, 1.8, 1.1, 1.1, 1, 1.2, 1.4])
        owner = (c[0].selectbox(kind.owner_label, owners, key=kind.owner_key, format_func=describe)
                 if owners else c[0].text_input(kind.owner_label, key=kind.owner_key))
        amount = c[1].number_input(f"Budget per period ({currency} or tokens)", min_value=0.0, max_value=1e12,
                                   value=0.0, step=10.0, format="%.6f", key=f"{kind.prefix}_amount")
        period = c[2].selectbox("Period", ("month", "day"), key=f"{kind.prefix}_period")
        unit = c[3].selectbox("Unit", ("money", "tokens"), key=f"{kind.prefix}_unit")
        soft = c[4].number_input("Warn at share", min_value=0.01, max_value=1.0, value=0.8, step=0.05,
                                 key=f"{kind.prefix}_soft_share")
        enforce = c[5].checkbox("Refuse at 100 %", value=True, key=f"{kind.prefix}_enforce")
        saved = c[6].form_submit_button(kind.set_label)
    box = st.container()
    if saved:
        problems = cd.budget_input_problems(kind.owner_label, owner, amount, unit, soft)
        if problems:
            box.error("Not changed: " + " · ".join(problems.values()))
        else:
            what = f"{cd.money(amount)} {currency}" if unit == "money" else f"{int(amount):,} tokens"
            session.write(lambda: session.client().set_budget(owner, float(amount), scope=kind.scope, period=period,
                                                              unit=unit, soft_share=float(soft),
                                                              enforce=bool(enforce)),
                          f"{kind.owner_label.lower()} {owner}: budget set to {what} per {period}", box)
    if budgeted:
        with st.form(f"{kind.prefix}_remove_form"):
            r = st.columns([2, 5])
            gone = r[0].selectbox(f"{kind.owner_label} with a budget", budgeted, key=f"{kind.prefix}_remove_owner",
                                  format_func=describe)
            removed = r[1].form_submit_button(kind.remove_label)
        out = st.container()
        if removed:
            session.write(lambda: session.client().delete_budget(gone, scope=kind.scope),
                          f"{kind.owner_label.lower()} {gone}: budget removed (no longer limited by it)", out)
