"""Client for the router's admin HTTP API: the UI's only write path (the router validates and audits).

Every call raises one of two errors the pages can show next to the control that caused it:
- `RouterDown`: the router cannot be reached (connection refused, timeout);
- `AdminApiError`: the router answered with an error (`status`, its `message`), e.g. 400 for a split
  that does not sum to 100, 403 for a viewer's write, 404 for an endpoint or replica that does not exist.
"""
from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx

DEFAULT_TIMEOUT_S = 5.0


class RouterDown(RuntimeError):
    """The router's admin API cannot be reached."""


class AdminApiError(RuntimeError):
    """The router refused a call; `message` is the router's own explanation."""

    def __init__(self, status: int, message: str, code: str = "") -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.code = code


class RouterClient:
    """Thin, synchronous wrapper over `/admin/*` with a bearer token (operator or viewer)."""

    def __init__(self, base_url: str, token: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    # --- plumbing -------------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict | None = None, params: dict | None = None) -> Any:
        url = f"{self.base_url}/admin{path}"
        try:
            resp = httpx.request(method, url, json=body, params=params, timeout=self.timeout_s,
                                 headers={"authorization": f"Bearer {self.token}"})
        except httpx.TransportError as exc:
            raise RouterDown(f"the router at {self.base_url} cannot be reached ({type(exc).__name__}: {exc})") from exc
        if resp.status_code >= 400:
            message, code = _error_message(resp)
            raise AdminApiError(resp.status_code, message, code)
        return resp.json()

    # --- reads ----------------------------------------------------------------------------------------
    def whoami(self) -> str:
        """The role of this token: `operator` or `viewer`."""
        return self._call("GET", "/whoami")["role"]

    def fleet(self) -> dict:
        """{registry_version, routes, replicas: [...]} as the router sees it now."""
        return self._call("GET", "/fleet")

    def rollout(self, model: str) -> dict:
        """{routes, rollout: {effective, versions, notes}}: what each version of `model` gets now and why,
        e.g. notes ["v1: 1 of 1 replicas ready, carrying 100 % (configured 80 %)", "v2: 0 of 1 replicas ready,
        20 % pending"]."""
        return self._call("GET", f"/models/{model}/rollout")

    def audit(self, limit: int = 100) -> list[dict]:
        return self._call("GET", "/audit", params={"limit": limit})["entries"]

    # --- writes (operator only; the router answers 403 to a viewer) -----------------------------------
    def set_percent(self, model: str, version: str, percent: int, override_quality_gate: str = "") -> dict[str, int]:
        """Give `version` `percent` of the traffic; the other routed versions share the rest.
        `override_quality_gate`: the operator's reason to ramp past the gated percentage without a passed gate
        (the router audits it as `quality_gate_override`)."""
        body: dict = {"version": version, "percent": percent}
        if override_quality_gate:
            body["override_quality_gate"] = override_quality_gate
        return self._call("POST", f"/models/{model}/rollout", body)["routes"]

    def set_split(self, model: str, split: dict[str, int]) -> dict[str, int]:
        return self._call("POST", f"/models/{model}/rollout", {"split": split})["routes"]

    def promote(self, model: str, version: str) -> dict[str, int]:
        return self._call("POST", f"/models/{model}/promote", {"version": version})["routes"]

    def rollback(self, model: str) -> dict[str, int]:
        return self._call("POST", f"/models/{model}/rollback")["routes"]

    def replica_action(self, replica_id: str, action: str) -> str:
        """`cordon`, `drain` or `uncordon`; returns the replica's new state."""
        return self._call("POST", f"/replicas/{replica_id}/{action}")["state"]

    def set_budget(self, owner: str, monthly_amount: float, scope: str = "team", **options: object) -> dict:
        """A team's budget per period (PUT /admin/budgets/{team}) or, with scope="key", one API key's own
        (PUT /admin/callers/{name}/budget); options: period, unit, soft_share, enforce. One path for both:
        the router validates and audits (set_budget / set_key_budget)."""
        return self._call("PUT", _budget_path(owner, scope), {"monthly_amount": monthly_amount, **options})

    def delete_budget(self, owner: str, scope: str = "team") -> dict:
        """DELETE the team's (or, scope="key", the key's own) budget; 404 when it has none (audited)."""
        return self._call("DELETE", _budget_path(owner, scope))

    def budgets(self) -> dict:
        """GET /admin/budgets: every budget with the routers' spend and reservations this period."""
        return self._call("GET", "/budgets")

    def rollback_rules(self) -> list[dict]:
        return self._call("GET", "/rollback-rules")["rules"]

    def set_rollback_rule(self, model: str, version: str, rule: dict) -> dict:
        """PUT /admin/rollback-rules/{model}/{version} with max_error_rate, max_ttft_ms_p95, minutes, armed."""
        return self._call("PUT", f"/rollback-rules/{model}/{version}", rule)

    def set_warm_buffer(self, model: str, version: str, settings: dict[str, int]) -> dict:
        """PUT /admin/warm-buffers/{model}/{version} with min_idle_replicas, min_replicas, max_replicas,
        slo_ttft_ms_p95, slo_tokens_per_s."""
        try:
            return self._call("PUT", f"/warm-buffers/{model}/{version}", settings)
        except AdminApiError as exc:
            if exc.status == 404 and not exc.code:  # the route itself is missing, not the model
                raise AdminApiError(404, "this router has no warm-buffer endpoint (PUT /admin/warm-buffers/"
                                         "{model}/{version}) yet; nothing was written") from exc
            raise


def _budget_path(owner: str, scope: str) -> str:
    if scope not in ("team", "key"):
        raise ValueError(f"budget scope is {scope!r}; allowed 'team' or 'key'")
    name = quote(owner, safe="")  # a name with '/' or spaces stays one path segment
    return f"/budgets/{name}" if scope == "team" else f"/callers/{name}/budget"


def _error_message(resp: httpx.Response) -> tuple[str, str]:
    try:
        err = resp.json().get("error") or {}
    except ValueError:
        return resp.text[:300] or resp.reason_phrase, ""
    if isinstance(err, dict):
        return str(err.get("message") or resp.reason_phrase), str(err.get("code") or "")
    return str(err), ""
