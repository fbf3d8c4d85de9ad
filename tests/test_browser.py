"""The HTML leaderboard in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``)
driven through Selenium. It renders, every header sorts best-first on the first click and flips on the
second, missing values stay last, and the page logs no console errors.

Skips, saying why, when the browser or Selenium is absent: ``scripts/setup_browser.sh`` installs the browser
(``.ci/run`` calls it) and ``pip install -e .[dev]`` installs Selenium.
"""

from __future__ import annotations

import math
import shutil

import pytest

from kvbench import leaderboard

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="headless Chromium absent: run scripts/setup_browser.sh (apt-get install chromium chromium-driver)")
webdriver = pytest.importorskip("selenium.webdriver", reason="dev dependency missing: pip install selenium")


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,900"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium then never tries to download one.
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page(store_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("board")
    assert leaderboard.main(["--results-dir", str(store_dir), "--out-dir", str(out)]) == 0
    return out / "leaderboard.html"


def _values(driver, table: int, col: int) -> list[str]:
    return driver.execute_script(
        "var t=document.querySelectorAll('table')[arguments[0]],c=arguments[1];"
        "return Array.prototype.map.call(t.tBodies[0].rows,function(r){return r.cells[c].getAttribute('data-v')});",
        table, col)


def _is_ordered(driver, values: list[str], ascending: bool) -> bool:
    """Missing values last; the rest numeric when every value is a number, else in the browser's collation."""
    present = [v for v in values if v != ""]
    if values[:len(present)] != present:
        return False
    try:
        nums = [float(v) for v in present]
    except ValueError:
        cmp = driver.execute_script(
            "var v=arguments[0],out=[];for(var i=1;i<v.length;i++){out.push(v[i-1].localeCompare(v[i]))}return out;",
            present)
        return all((c <= 0) if ascending else (c >= 0) for c in cmp)
    nums = [n for n in nums if not math.isnan(n)]
    return nums == sorted(nums, reverse=not ascending)


def _console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_page_renders_without_console_errors(browser, page, tmp_path):
    browser.get(page.as_uri())
    assert browser.title == "kvbench leaderboard"
    body = browser.find_element("tag name", "body").text
    assert "kvbench leaderboard" in body and "Query-agnostic" in body
    assert "**" not in body and "`" not in body  # markdown is rendered, not shown literally
    assert browser.find_elements("css selector", "p code") and browser.find_elements("css selector", "p strong")
    rows = browser.find_elements("css selector", "tbody tr")
    csv_rows = (page.parent / "leaderboard.csv").read_text().strip().splitlines()[1:]
    assert len(rows) == len(csv_rows) and all(r.is_displayed() for r in rows)
    shot = tmp_path / "shot.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    assert _console_errors(browser) == []


def test_every_header_sorts_best_first_then_flips(browser, page):
    browser.get(page.as_uri())
    tables = browser.find_elements("tag name", "table")
    assert tables
    for t, table in enumerate(tables):
        heads = table.find_elements("css selector", "thead th")
        for col, th in enumerate(heads):
            best = th.get_attribute("data-best")
            assert best in ("asc", "desc")
            # The column the page was sorted by starts marked; its first click flips, every other starts best.
            first = ("asc" if best == "desc" else "desc") if "desc" in (th.get_attribute("class") or "") or \
                "asc" in (th.get_attribute("class") or "") else best
            th.click()
            assert first in th.get_attribute("class")
            assert _is_ordered(browser, _values(browser, t, col), first == "asc"), (th.text, first)
            th.click()
            second = "asc" if first == "desc" else "desc"
            assert second in th.get_attribute("class")
            assert _is_ordered(browser, _values(browser, t, col), second == "asc"), (th.text, second)
            # Only the clicked header carries a direction.
            marked = [h for h in heads if set((h.get_attribute("class") or "").split()) & {"asc", "desc"}]
            assert marked == [th]
    assert _console_errors(browser) == []


def test_first_click_on_delta_shows_the_best_strategies_first(browser, page):
    browser.get(page.as_uri())
    table = browser.find_elements("tag name", "table")[0]
    heads = table.find_elements("css selector", "thead th")
    col, th = next((i, h) for i, h in enumerate(heads) if h.get_attribute("data-key") == "alpha.delta_pp")
    th.click()
    values = [float(v) for v in _values(browser, 0, col) if v != ""]
    assert values[0] == max(values)  # not the worst Δ first
