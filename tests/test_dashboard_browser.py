"""The dashboard in a real browser (Debian ``chromium`` driven by Playwright for Python).

Checks, against running services with a workload: the page's numbers equal ``/metrics``
read at the same moment (the workload paused), the charts move while the workload runs,
a Clear button really empties an instance's tier (read from the manager, not the page),
a controller with a token shows nothing but a sign-in form until the viewer signs in (a
wrong token is refused; the session is a cookie the page's script never reads), and axe-core
finds no serious or critical
accessibility violation. Screenshots go to ``$KVTIER_TEST_ARTIFACTS`` (default
``tests/artifacts``); the controller view's is also written to ``docs/dashboard.png``
when ``KVTIER_UPDATE_DOCS=1``.

Skipped (with the reason) when the ``chromium`` binary or the ``playwright`` package is
missing: ``apt-get install chromium`` and ``pip install -e .[dashboard]`` (never
``playwright install``: the system browser is used).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no chromium binary (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install -e .[dashboard])")

from service_helpers import connect, short_dir, start_server  # noqa: F401 (fixture)
from test_dashboard_controller import TOKEN, TokenCluster

from kvtier.dashboard.samples import parse_exposition

ROOT = Path(__file__).resolve().parent.parent
AXE = ROOT / "kvtier" / "dashboard" / "testing" / "axe.min.js"


def artifacts() -> Path:
    d = Path(os.environ.get("KVTIER_TEST_ARTIFACTS") or ROOT / "tests" / "artifacts")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    pw = sync_api.sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
    except Exception as exc:  # a broken install: say why
        pw.stop()
        pytest.skip(f"chromium did not start under playwright: {exc}")
    yield b
    b.close()
    pw.stop()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1400, "height": 1100})
    p = ctx.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.errors = errors
    yield p
    ctx.close()
    assert not errors, errors  # no JavaScript exception while the test ran


def get(url: str, headers: dict[str, str] | None = None) -> bytes:
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10).read()


def page_cells(page: Any) -> list[dict[str, str]]:
    """Every number on the page that names its series: series, raw value, shown text."""
    return page.eval_on_selector_all(
        "[data-series][data-value]",
        "els => els.map(e => ({series: e.dataset.series, value: e.dataset.value, text: e.textContent}))")


def wait_render_after(page: Any, t: float, timeout_s: float = 10.0) -> None:
    """Wait until the page rendered a snapshot taken after wall time ``t``."""
    page.wait_for_function(f"window.__kvtier.snap && window.__kvtier.snap.time > {t}", timeout=timeout_s * 1000)


def axe_serious(page: Any) -> list[dict[str, Any]]:
    page.add_script_tag(path=str(AXE))
    result = page.evaluate("async () => await axe.run(document, {resultTypes: ['violations']})")
    return [{"id": v["id"], "impact": v["impact"], "help": v["help"], "nodes": [n["html"][:120] for n in v["nodes"][:3]]}
            for v in result["violations"] if v["impact"] in ("serious", "critical")]


class Workload:
    """A thread looking up (and storing) chains through a real client until stopped."""

    def __init__(self, sock: Path):
        self.client = connect(sock)
        self.stop = threading.Event()
        self.rounds = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        c, i = self.client, 0
        while not self.stop.is_set():
            chain = [bytes([1 + i % 5, j + 1]) * 16 for j in range(4)]
            got = c.lookup_keys(chain, None)
            if len(got.keys) < len(chain):
                parent = chain[len(got.keys) - 1] if got.keys else None
                for k in chain[len(got.keys):]:
                    buf = c.open_write(k, parent)
                    if buf is None:
                        break
                    buf[:] = 7
                    c.commit(k, parent)
                    parent = k
            i += 1
            self.rounds += 1
            time.sleep(0.005)

    def __enter__(self) -> Workload:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pause()
        self.client.close()

    def pause(self) -> None:
        self.stop.set()
        self.thread.join(10)


def test_server_page_agrees_with_metrics_and_charts_move(page: Any, short_dir: Path) -> None:  # noqa: F811
    with start_server(short_dir, cpu_chunks=12, disk=True, metrics_port=0) as srv:
        base = f"http://127.0.0.1:{srv.metrics_port}"
        with Workload(short_dir / "s.sock") as w:
            page.goto(base + "/")
            page.wait_for_function("window.__kvtier.renders > 0")
            page.wait_for_function("(window.__kvtier.charts['chart-tput'] || {}).points >= 2", timeout=15000)
            first = page.evaluate("window.__kvtier.charts['chart-tput'].lastT")
            rounds = w.rounds
            wait_render_after(page, first + 1.5)
            moved = page.evaluate("window.__kvtier.charts['chart-tput'].lastT")
            assert moved > first and w.rounds > rounds  # new points while the workload ran
            lookups = page.evaluate("window.__kvtier.snap.history.short.lookups")
            assert max(lookups) > 0, lookups
            assert page.locator("#hot tbody tr[data-head]").count() >= 1
            w.pause()
            paused_at = time.time()
            wait_render_after(page, paused_at + 0.2)
            cells = page_cells(page)
            metrics = parse_exposition(get(base + "/metrics").decode())
        assert len(cells) >= 15, cells
        for c in cells:
            assert float(c["value"]) == metrics[c["series"]], c
            if "GiB" not in c["text"] and "B" not in c["text"]:  # counts are shown in full
                assert c["text"].replace(",", "") == str(int(float(c["value"]))), c
        assert float(page.get_attribute('td[data-series="kvtier_cpu_chunks"]', "data-value")) > 0
        page.screenshot(path=str(artifacts() / "dashboard-server.png"), full_page=True)
        assert axe_serious(page) == []


def demo_prompts(n: int) -> tuple[list[list[int]], str | None]:
    """``n`` token prompts of the demo workload (real tokenizer when the demo model is prepared),
    else synthetic ids; and the tokenizer path (None when synthetic)."""
    try:
        from transformers import AutoTokenizer

        from kvtier.demo.model import prepare_model
        from kvtier.demo.workload import load_documents, prompt_token_ids

        path = str(prepare_model().path)
        tok = AutoTokenizer.from_pretrained(path)
        docs = load_documents()
        return [prompt_token_ids(tok, docs[i % len(docs)], docs[i % len(docs)].questions[0])[:1024]
                for i in range(n)], path
    except Exception:
        return [[1000 * (i + 1) + j for j in range(512)] for i in range(n)], None


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TokenCluster, list[list[int]]]]:
    prompts, tok = demo_prompts(4)
    if tok:
        monkeypatch.setenv("KVTIER_DASHBOARD_TOKENIZER", tok)
    monkeypatch.setenv("KVTIER_CONTROLLER_TOKEN", TOKEN)
    c = TokenCluster("disk", tmp_path, n=2, cpu_chunks=160)
    c.start()
    try:
        yield c, prompts
    finally:
        c.close()


def lookup(base: str, tokens: list[int]) -> dict[str, Any]:
    req = urllib.request.Request(base + "/lookup", json.dumps({"tokens": tokens}).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())


def test_controller_page_clear_button_empties_the_tier(page: Any, fleet: tuple[TokenCluster, list[list[int]]]) -> None:
    cluster, prompts = fleet
    a, b = cluster.instances
    for i, p in enumerate(prompts):
        (a if i % 2 == 0 else b).store(p)
    cluster.settle()
    base = cluster.controller.http_url
    page.goto(base + "/")
    page.wait_for_selector("#token-form:not([hidden])")  # signed out: a sign-in form, no data
    assert page.evaluate("window.__kvtier.renders") == 0 and page.locator("#tiers tbody tr").count() == 0
    assert axe_serious(page) == []
    page.fill("#token", "wrong")
    page.click("#token-form button[type=submit]")
    page.wait_for_function("document.getElementById('status').textContent.includes('wrong token')")
    assert page.evaluate("window.__kvtier.renders") == 0
    page.fill("#token", TOKEN)
    page.click("#token-form button[type=submit]")
    page.wait_for_function("window.__kvtier.renders > 0")
    assert page.evaluate("document.cookie") == ""  # HttpOnly: the page's script never sees the session
    assert page.evaluate("Object.keys(sessionStorage).length + Object.keys(localStorage).length") == 0
    for i in range(24):  # the demo's prompts asked again over ~5 s, with a question tail not cached
        lookup(base, prompts[i % len(prompts)] + [7] * 64)
        if i % 3 == 2:
            lookup(base, [9] * 256)  # a prompt nobody cached: a miss
        time.sleep(0.2)
    wait_render_after(page, time.time() + 0.2)
    held_a = len(a.manager.cpu)
    assert held_a > 0 and len(b.manager.cpu) > 0
    metrics = parse_exposition(get(base + "/metrics", {"Authorization": f"Bearer {TOKEN}"}).decode())
    for c in page_cells(page):  # no workload runs: the page and /metrics agree
        assert float(c["value"]) == metrics[c["series"]], c
    assert page.locator("#hot tbody tr[data-head]").count() == len(prompts)
    assert page.locator("#instances tbody tr").count() == 2
    page.screenshot(path=str(artifacts() / "dashboard-controller.png"), full_page=True)
    if os.environ.get("KVTIER_UPDATE_DOCS") == "1":
        (ROOT / "docs").mkdir(exist_ok=True)
        page.screenshot(path=str(ROOT / "docs" / "dashboard.png"), full_page=True)
    assert axe_serious(page) == []

    clear = page.locator(f'#tiers tr[data-instance="{a.name}"][data-tier="cpu"] button')
    clear.click()
    page.click("#confirm-cancel")  # cancelled: nothing runs
    time.sleep(0.3)
    assert len(a.manager.cpu) == held_a and page.locator("#ops-log li").count() == 0
    clear.click()
    page.click("#confirm-ok")
    page.wait_for_selector("#ops-log li[data-state]", timeout=15000)
    assert page.get_attribute("#ops-log li", "data-state") == "done", page.inner_text("#ops-log")
    assert len(a.manager.cpu) == 0 and len(b.manager.cpu) > 0  # the real tier, not the page
    cell = f'#tiers tr[data-instance="{a.name}"][data-tier="cpu"] td[data-series*="tier_chunks"]'
    page.wait_for_function(f"document.querySelector('{cell}').dataset.value === '0'", timeout=10000)

    pin = page.locator('#hot tr[data-head] button:text("Pin")').first
    pin.click()
    page.click("#confirm-ok")
    page.wait_for_function("document.querySelectorAll('#ops-log li[data-state]').length >= 2", timeout=15000)
    assert page.get_attribute("#ops-log li", "data-state") == "done", page.inner_text("#ops-log")
    assert a.manager.stats()["pinned_chunks"] + b.manager.stats()["pinned_chunks"] > 0
    page.wait_for_function("[...document.querySelectorAll('#hot td')].some(td => td.textContent.startsWith('yes'))",
                           timeout=10000)  # the hot prefix's pin state, read live from the index
    page.screenshot(path=str(artifacts() / "dashboard-controller-after-ops.png"), full_page=True)
