"""Drive the running admin UI in headless Chromium (Debian's /usr/bin/chromium through Playwright):
sign in, open every page from the sidebar, collect Streamlit exceptions and error boxes, take screenshots."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
WRITE_BUTTONS = ("Apply percent", "Apply split", "Promote…", "Roll back…", "Save", "Apply")
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
    write_controls: int = 0  # buttons that change the fleet (Apply, Promote…, Roll back…, Save)


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
    """Wait until every plotly chart on the page has drawn its SVG (a live fragment may redraw them)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if page.evaluate("""() => Array.from(document.querySelectorAll('[data-testid="stPlotlyChart"]'))
                .every(c => c.querySelector('.main-svg .plot') !== null)"""):
            break
        page.wait_for_timeout(250)
    page.wait_for_timeout(500)


def _report(page, name: str, out: Path) -> PageReport:
    exceptions = [e.inner_text()[:500] for e in page.locator('[data-testid="stException"]').all()]
    errors = [e.inner_text()[:500] for e in page.locator('[data-testid="stAlertContentError"]').all()]
    # Streamlit scrolls inside its main block, so grow the viewport to the content for a whole-page shot.
    height = page.evaluate("""() => { const m = document.querySelector('[data-testid="stMain"]')
        || document.querySelector('section.main'); return m ? m.scrollHeight : document.body.scrollHeight; }""")
    page.set_viewport_size({"width": VIEWPORT["width"], "height": int(min(max(height, VIEWPORT["height"]), 5000))})
    _settle(page)
    _charts_drawn(page)
    page.screenshot(path=str(out), full_page=True)
    page.set_viewport_size(VIEWPORT)
    writes = sum(page.get_by_role("button", name=n, exact=True).count() for n in WRITE_BUTTONS)
    return PageReport(name, out, exceptions, errors, writes)


def _sign_in(page, token: str) -> None:
    page.get_by_label("Admin or viewer token").fill(token)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("heading", name="Fleet").wait_for()


def _open(page, label: str) -> None:
    page.locator('[data-testid="stSidebarNav"]').get_by_text(label, exact=True).click()
    page.get_by_role("heading", name=PAGES[label][1], exact=True).wait_for()
    _settle(page)


def capture_admin_ui(ui_url: str, token: str, out_dir: Path, simulate: bool = True, timeout_s: float = 90.0,
                     viewer_token: str | None = None) -> list[PageReport]:
    """Sign in with `token`, visit the login page and every page, screenshot each to out_dir/admin-<slug>.png;
    with `viewer_token`, sign out, sign in as a viewer and add admin-rollouts-viewer.png."""
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    reports: list[PageReport] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(timeout_s * 1000)
            page.goto(ui_url)
            page.get_by_label("Admin or viewer token").wait_for()
            _settle(page)
            reports.append(_report(page, "login", out_dir / "admin-login.png"))
            _sign_in(page, token)
            for label, (slug, _title) in PAGES.items():
                _open(page, label)
                if slug == "capacity" and simulate:
                    page.get_by_role("button", name="Simulate").click()
                    page.get_by_text("peak GPUs").wait_for(timeout=timeout_s * 1000)
                    _settle(page)
                reports.append(_report(page, slug, out_dir / f"admin-{slug}.png"))
            if viewer_token:
                page.get_by_role("button", name="Sign out").click()
                page.get_by_label("Admin or viewer token").wait_for()
                _sign_in(page, viewer_token)
                _open(page, "Models & rollouts")
                reports.append(_report(page, "rollouts-viewer", out_dir / "admin-rollouts-viewer.png"))
        finally:
            browser.close()
    return reports
