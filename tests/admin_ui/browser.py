"""Drive the running admin UI in headless Chromium (Debian's /usr/bin/chromium through Playwright):
sign in, open every page from the sidebar, collect Streamlit exceptions and error boxes, take screenshots,
reload to check the session survives, open deep links, read metrics and warnings, count write controls, and set
an API key's budget through the chargeback page's form."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
WRITE_BUTTONS = ("Apply percent…", "Apply split…", "Promote…", "Roll back…", "Save", "Apply…", "Set budget",
                 "Remove budget", "Set key budget", "Remove key budget", "Save rule", "Confirm")
VIEWPORT = {"width": 1440, "height": 900}
# sidebar label -> screenshot slug and the page's title (h1) to wait for
PAGES = {"Fleet": ("fleet", "Fleet"), "Models & rollouts": ("rollouts", "Models & rollouts"),
         "Warm buffers & autoscaling": ("buffers", "Warm buffers & autoscaling"),
         "Chargeback": ("chargeback", "Chargeback"), "Capacity": ("capacity", "Capacity")}


@dataclass
class PageReport:
    name: str
    screenshot: Path
    exceptions: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    write_controls: int = 0  # buttons that change the fleet (Apply…, Promote…, Roll back…, Save, Set budget…)
    warnings: list[str] = field(default_factory=list)
    metrics: dict[str, str] = field(default_factory=dict)


def _settle(page, timeout_s: float = 60.0) -> None:
    """Wait until Streamlit has finished the script run (no 'running' status widget) and charts drew."""
    deadline = time.monotonic() + timeout_s
    page.wait_for_timeout(500)
    while time.monotonic() < deadline:
        if page.locator('[data-testid="stStatusWidget"]').count() == 0:
            break
        page.wait_for_timeout(250)
    page.wait_for_timeout(1500)  # plotly and data grids render after the run


def _charts_drawn(page, timeout_s: float = 15.0) -> None:
    """Wait until every plotly chart on screen has drawn its SVG (a live fragment may redraw them). Charts in
    tabs not shown are not drawn until their tab is: waiting for them cost every such page the whole timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if page.evaluate("""() => Array.from(document.querySelectorAll('[data-testid="stPlotlyChart"]'))
                .filter(c => c.offsetParent !== null && c.getClientRects().length > 0)
                .every(c => c.querySelector('.main-svg') !== null)"""):
            break
        page.wait_for_timeout(250)
    page.wait_for_timeout(500)


def _report(page, name: str, out: Path) -> PageReport:
    exceptions = [e.inner_text()[:500] for e in page.locator('[data-testid="stException"]').all()]
    errors = [e.inner_text()[:500] for e in page.locator('[data-testid="stAlertContentError"]').all()]
    warnings = [e.inner_text()[:500] for e in page.locator('[data-testid="stAlertContentWarning"]').all()]
    metrics = {m.locator('[data-testid="stMetricLabel"]').inner_text().strip():
               m.locator('[data-testid="stMetricValue"]').inner_text().strip()
               for m in page.locator('[data-testid="stMetric"]').all()}
    # Streamlit scrolls inside its main block, so grow the viewport to the content for a whole-page shot.
    height = page.evaluate("""() => { const m = document.querySelector('[data-testid="stMain"]')
        || document.querySelector('section.main'); return m ? m.scrollHeight : document.body.scrollHeight; }""")
    page.set_viewport_size({"width": VIEWPORT["width"], "height": int(min(max(height, VIEWPORT["height"]), 5000))})
    _settle(page)
    _charts_drawn(page)
    page.screenshot(path=str(out), full_page=True)
    page.set_viewport_size(VIEWPORT)
    # every button in the DOM, hidden tabs included, whose text is a write control's label
    labels = [b.inner_text().strip() for b in page.locator("button").all()]
    writes = sum(label in WRITE_BUTTONS for label in labels)
    return PageReport(name, out, exceptions, errors, writes, warnings, metrics)


def _sign_in(page, token: str) -> None:
    page.get_by_label("Admin or viewer token").fill(token)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("heading", name="Fleet").wait_for()


def _open(page, label: str) -> None:
    page.locator('[data-testid="stSidebarNav"]').get_by_text(label, exact=True).click()
    page.get_by_role("heading", name=PAGES[label][1], exact=True).wait_for()
    _settle(page)


@dataclass(frozen=True)
class KeyBudget:
    """An API key's own budget for the tour to set on the chargeback page (admin_ui/budget_form.py's form)."""
    caller: str
    amount: int
    unit: str = "tokens"
    period: str = "day"


def _choose(page, scope, label: str, option: str) -> None:
    """Pick `option` in the Streamlit selectbox labelled `label` inside `scope` (a combobox that opens on the arrow
    key, not on a click; its list opens at page level and hides the rest of the page from role queries)."""
    combo = scope.get_by_role("combobox", name=label, exact=True)
    combo.click()
    if page.get_by_role("listbox").count() == 0:
        page.keyboard.press("ArrowDown")
    page.get_by_role("option").filter(has_text=re.compile(rf"^{re.escape(option)}\b")).first.click()


def set_key_budget(page, budget: KeyBudget, timeout_s: float) -> str:
    """Fill and submit the key-budget form as an operator would; returns the success message the page shows."""
    form = page.locator('[data-testid="stForm"]').filter(has=page.get_by_role("button", name="Set key budget"))
    _choose(page, form, "Caller (API key)", budget.caller)
    amount = form.get_by_label(re.compile(r"^Budget per period"))
    amount.fill(str(budget.amount))
    amount.press("Tab")
    _choose(page, form, "Unit", budget.unit)
    _choose(page, form, "Period", budget.period)
    form.get_by_role("button", name="Set key budget").click()
    done = page.locator('[data-testid="stAlertContentSuccess"]').filter(has_text=f"{budget.caller}: budget set")
    done.wait_for(timeout=timeout_s * 1000)
    _settle(page)
    return done.inner_text()


@dataclass
class Tour:
    reports: list[PageReport]
    reload_kept_session: bool = False
    deep_link: PageReport | None = None
    viewer: list[PageReport] = field(default_factory=list)
    key_budget_message: str = ""  # what the chargeback page said after the tour set `key_budget`


def tour_admin_ui(ui_url: str, token: str, viewer_token: str, out_dir: Path, deep_link: str,
                  simulate: bool = True, timeout_s: float = 90.0, key_budget: KeyBudget | None = None) -> Tour:
    """As an operator: the login page, every page (screenshots out_dir/admin-<slug>.png; on the chargeback page
    `key_budget` is set through its form first), a reload, and the chargeback deep link `deep_link` (path + query,
    e.g. '/chargeback?team=search'); then as a viewer: every page again (admin-<slug>-viewer.png for rollouts),
    counting write controls."""
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(timeout_s * 1000)
            page.goto(ui_url)
            page.get_by_label("Admin or viewer token").wait_for()
            _settle(page)
            tour = Tour([_report(page, "login", out_dir / "admin-login.png")])
            _sign_in(page, token)
            for label, (slug, _title) in PAGES.items():
                _open(page, label)
                if slug == "chargeback" and key_budget is not None:
                    tour.key_budget_message = set_key_budget(page, key_budget, timeout_s)
                if slug == "capacity" and simulate:
                    page.get_by_role("button", name="Simulate").click()
                    page.get_by_text("peak GPUs").wait_for(timeout=timeout_s * 1000)
                    _settle(page)
                tour.reports.append(_report(page, slug, out_dir / f"admin-{slug}.png"))
            page.reload()  # a new Streamlit session: the cookie must sign it in again
            page.get_by_role("heading", name="Capacity", exact=True).wait_for()
            _settle(page)
            tour.reload_kept_session = page.get_by_label("Admin or viewer token").count() == 0
            page.goto(ui_url.rstrip("/") + deep_link)
            page.get_by_role("heading", name="Chargeback", exact=True).wait_for()
            _settle(page)
            tour.deep_link = _report(page, "chargeback-filtered", out_dir / "admin-chargeback-filtered.png")
            page.get_by_role("button", name="Sign out").click()
            page.get_by_label("Admin or viewer token").wait_for()
            _sign_in(page, viewer_token)
            for label, (slug, _title) in PAGES.items():
                if slug == "capacity":
                    continue
                _open(page, label)
                shot = out_dir / f"admin-{slug}-viewer.png"
                tour.viewer.append(_report(page, f"{slug}-viewer", shot))
                if slug != "rollouts":
                    shot.unlink()  # only the rollouts page's viewer shot goes in the docs
        finally:
            browser.close()
    return tour
