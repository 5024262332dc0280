"""The lineage page at `/`, in a real headless Chromium (Debian's package, driven by Playwright with
`executable_path`; no browser download): one node per version, a click shows the record and the diff
against the parent, two selected versions show their diff, the filter narrows the graph, and a store of
thousands of versions scrolls with a bounded number of rows in the page."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.server_proc import ServerProc
from server_fixtures import build_lineage_store

import datastates as ds

CHROMIUM = os.environ.get("DATASTATES_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

sync_api = pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lineage_store(tmp_path_factory.mktemp("web") / "store")


@pytest.fixture(scope="module")
def srv(store_path: Path) -> Iterator[ServerProc]:
    with ServerProc(store_path) as s:
        yield s


@pytest.fixture()
def page(browser: Any, srv: ServerProc) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    ctx.set_default_timeout(120_000)  # a busy CI machine; every wait below ends on an event, not a time
    pg = ctx.new_page()
    pg.goto(srv.url + "/")
    yield pg
    ctx.close()


def _wait_status(page: Any, text: str) -> None:
    page.wait_for_function("t => document.getElementById('status').textContent === t", arg=text, timeout=120_000)


def test_one_node_per_version_and_refs_shown(page: Any, store_path: Path, tmp_path: Path) -> None:
    with ds.Store.open(store_path, create=False) as s:
        n = len(s.find(""))
        main = s.resolve("main")
    _wait_status(page, f"{n} versions")
    assert page.locator("circle.node").count() == n
    assert page.locator(f".row[data-id='{main}'] .ref").first.inner_text() == "main"
    assert page.locator(".row .ref.tag").inner_text() == "tag: best"
    page.screenshot(path=str(tmp_path / "lineage.png"))
    assert (tmp_path / "lineage.png").stat().st_size > 1000


def test_click_shows_metrics_and_the_diff_against_the_parent(page: Any, store_path: Path) -> None:
    with ds.Store.open(store_path, create=False) as s:
        v = s.version("main~1")
        want = s.diff(v.parents[0], v.id).to_pylist()
        n = len(s.find(""))
    _wait_status(page, f"{n} versions")
    page.locator(f".row[data-id='{v.id}']").click()
    page.wait_for_selector("#diff-table tbody tr")
    record = page.locator(".record").inner_text()
    assert v.id in record and "metrics.loss" in record and f"{v.metrics['loss']}" in record
    assert page.locator(".record .tiers").inner_text() == "hot"
    assert page.locator("#diff-table tbody tr").count() == len(want)
    page.locator("#diff-table th[data-col='key']").click()  # sortable: by key, ascending
    keys = page.locator("#diff-table tbody tr").evaluate_all("rows => rows.map(r => r.dataset.key)")
    assert keys == sorted(r["key"] for r in want)


def test_two_selected_versions_show_their_diff(page: Any, store_path: Path) -> None:
    with ds.Store.open(store_path, create=False) as s:
        a, b = s.resolve("main~4"), s.resolve("lr/high")
        want = s.diff(a, b).to_pylist()
    page.wait_for_selector(f".row[data-id='{a}']")
    page.locator(f".row[data-id='{a}']").click()
    page.wait_for_selector("#diff-table tbody tr")
    page.locator(f".row[data-id='{b}']").click(modifiers=["Shift"])
    page.wait_for_function("t => document.querySelector('#diff h3') && document.querySelector('#diff h3')"
                           ".textContent.startsWith(t) && document.querySelector('#diff-table')",
                           arg=f"diff {a[:10]}", timeout=120_000)
    statuses = page.locator("#diff-table tbody tr").evaluate_all(
        "rows => rows.map(r => [r.dataset.key, r.children[1].textContent])")
    assert sorted(statuses) == sorted([r["key"], r["status"]] for r in want)


def test_the_filter_narrows_the_graph_and_bad_queries_say_why(page: Any, store_path: Path) -> None:
    with ds.Store.open(store_path, create=False) as s:
        want = {v.id for v in s.find("step >= 30")}
    page.wait_for_selector("circle.node")
    page.fill("#filter", "step >= 30")
    page.click("#apply")
    _wait_status(page, f"{len(want)} versions")
    shown = page.locator(".row").evaluate_all("rows => rows.map(r => r.dataset.id)")
    assert set(shown) == want
    page.fill("#filter", "metrics.loss <")
    page.click("#apply")
    page.wait_for_selector("#status.error")
    assert "BAD_QUERY" in page.locator("#status").inner_text()


def test_thousands_of_versions_scroll_with_a_bounded_dom(browser: Any, tmp_path: Path) -> None:
    n = 1500
    with ds.Store.open(tmp_path / "big") as s:
        ids = [s.save({"w": torch.full((2,), float(i))}, step=i, metrics={"loss": 1 / (i + 1)}).id for i in range(n)]
    with ServerProc(tmp_path / "big") as srv:
        ctx = browser.new_context(viewport={"width": 1200, "height": 800})
        ctx.set_default_timeout(120_000)
        pg = ctx.new_page()
        pg.goto(srv.url + "/")
        _wait_status(pg, f"{n} versions")
        assert pg.locator(".row").count() < 120  # virtualized: only the rows near the viewport exist
        pg.evaluate("document.getElementById('scroller').scrollTop = 1e9")
        pg.wait_for_selector(f".row[data-id='{ids[0]}']", timeout=120_000)  # the oldest, at the very bottom
        assert pg.locator(".row").count() < 120
        ctx.close()
