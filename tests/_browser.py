"""Opening a page in a real browser: Debian's ``chromium`` (scripts/setup.sh
installs it), headless, driven by Playwright's Python package through
``executable_path`` (Playwright's own browser downloads are never used).

Why Playwright rather than ``chromium --headless --dump-dom``: it waits for a
condition the page sets (every chart drawn) instead of a fixed delay, it hears
every uncaught exception (``pageerror``) and ``console.error`` as events, not
by scraping the browser's log, and it sees every request the page makes, so a
test can assert that nothing left the file (no network at view time).

    python tests/_browser.py report.html shot.png     # by hand: what a test sees
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any, Dict, List, Optional

#: Where Debian's package puts it (``chromium``), or a name on PATH.
CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser")


def find_chromium() -> Optional[str]:
    override = os.environ.get("LAZYCKPT_CHROMIUM")
    if override:
        return override
    for name in CANDIDATES:
        path = name if os.path.isabs(name) else shutil.which(name)
        if path and os.access(path, os.X_OK):
            return path
    return None


def open_page(path: str, screenshot: Optional[str] = None, timeout_s: float = 30.0,
              width: int = 1400, height: int = 900) -> Dict[str, Any]:
    """Open the file ``path`` in headless Chromium, wait until the page says
    its charts are drawn (``body[data-charts-rendered]``), and return what a
    test checks: ``errors`` (uncaught exceptions and console errors),
    ``requests`` (URLs that are not the file itself, ``data:`` or ``blob:``),
    ``charts`` (chart divs, and those plotly drew an SVG into), ``tables``
    (rows per table class), ``rendered`` (the page's own count),
    ``title``, ``launch_s`` (starting Chromium) and ``draw_s`` (from opening
    the file to every chart drawn). ``screenshot``: a full-page PNG there."""
    from playwright.sync_api import sync_playwright
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("chromium not found: apt-get install chromium (scripts/setup.sh does)")
    errors: List[str] = []
    requests: List[str] = []
    url = "file://" + os.path.abspath(path)
    t0 = time.perf_counter()
    with sync_playwright() as p:
        # --no-sandbox: as root (CI here) Chromium refuses to start with its sandbox.
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        launched = time.perf_counter()
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
            page.on("console", lambda msg: errors.append(f"console.{msg.type}: {msg.text}")
                    if msg.type == "error" else None)
            page.on("request", lambda req: requests.append(req.url)
                    if not req.url.startswith(("data:", "blob:")) and req.url != url else None)
            opened = time.perf_counter()
            page.goto(url, wait_until="load", timeout=timeout_s * 1e3)
            rendered = None
            try:
                page.wait_for_selector("body[data-charts-rendered]", state="attached", timeout=timeout_s * 1e3)
                rendered = int(page.get_attribute("body", "data-charts-rendered"))
            except Exception as exc:        # reported, not raised: the test names what is missing
                errors.append(f"the page never said its charts were drawn: {exc}")
            drawn_s = time.perf_counter() - opened
            info = page.evaluate("""() => ({
                charts: document.querySelectorAll('div.chart').length,
                drawn: Array.from(document.querySelectorAll('div.chart'))
                            .filter(d => d.querySelector('svg.main-svg')).length,
                traces: Object.fromEntries(Array.from(document.querySelectorAll('div.chart'))
                            .map(d => [d.id, d.querySelectorAll('g.trace').length])),
                tables: Object.fromEntries(Array.from(document.querySelectorAll('table'))
                            .map(t => [t.className, t.querySelectorAll('tbody tr').length])),
                sections: Array.from(document.querySelectorAll('section[id]')).map(s => s.id),
            })""")
            if screenshot is not None:
                page.screenshot(path=screenshot, full_page=True)
            info.update(errors=errors, requests=requests, rendered=rendered, title=page.title(),
                        launch_s=launched - t0, draw_s=drawn_s)
            return info
        finally:
            browser.close()


if __name__ == "__main__":
    print(open_page(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
