"""``rollout view`` in a real headless browser (Debian's chromium and its driver, through
selenium): the pages render, the figures equal the rollout's ``summary.json``, the timeline
shows every sample, planted markup does not execute, and a live page updates without a
reload.

One rollout is made once and one browser session drives every test (the module's fixtures).
The viewer serves an in-memory log from a thread of its own, as ``rollout view`` serves one
from Redis. Screenshots of each page go to ``$VIEW_SCREENSHOTS`` when set (``docs/view`` to
refresh the documentation's), else to a temporary folder. Without chromium, chromedriver or
selenium the module is skipped; under ``CI=true`` it fails (``.ci/run`` installs them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from bench.view import synthetic_rollout
from engine.events.memory_log import MemoryEventLog
from engine.ops.replay import decode_entries, replay_state
from engine.ops.view import ViewData, serve
from engine.projections.summary import build_summary
from tests.ops.test_view import write_timed
from tests.redis_server import redis_required

T = TypeVar("T")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
RID = "it3-view"


def _browser_or_skip() -> Any:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    missing = [name for name, found in (("chromium", CHROMIUM), ("chromedriver", DRIVER),
                                        ("selenium", webdriver)) if not found]
    if missing:
        if redis_required():
            pytest.fail(f"{', '.join(missing)} missing in CI: .ci/run must install them")
        pytest.skip(f"no browser to drive: {', '.join(missing)} not installed")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1300,1100"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(DRIVER))


class Served:
    """The viewer on an in-memory log, served from its own thread and loop."""

    def __init__(self) -> None:
        self.log = MemoryEventLog()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        urls: queue.Queue[str] = queue.Queue()

        async def start() -> asyncio.Task[None]:
            return asyncio.create_task(serve(ViewData(self.log), port=0, ready=urls.put))

        self.task = self.call(start())
        self.url = urls.get(timeout=20).rstrip("/")

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(20)

    def write(self, events: list[tuple[str, object, int]]) -> None:
        async def write() -> None:
            write_timed(self.log, events)

        self.call(write())

    def close(self) -> None:
        async def stop() -> None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = _browser_or_skip()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def served(browser: Any) -> Iterator[Served]:
    server = Served()
    server.write(synthetic_rollout(RID, 64, hostile=True, long_tokens=300))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = os.environ.get("VIEW_SCREENSHOTS")
    out = Path(target) if target else tmp_path_factory.mktemp("view-shots")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _summary(served: Served, rid: str) -> dict[str, Any]:
    stream = served.log.names.rollout(rid)
    raw = served.call(served.log.read_raw(stream))
    return build_summary(replay_state(decode_entries(stream, raw)[0]))


def _figure(browser: Any, key: str) -> str:
    from selenium.webdriver.common.by import By

    return str(browser.find_element(By.CSS_SELECTOR, f'[data-k="{key}"]').text)


def _wait(check: Any, what: str, timeout_s: float = 10.0) -> None:
    from selenium.common.exceptions import WebDriverException

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except WebDriverException:  # the element was swapped out while it was read
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_the_rollout_page_shows_summary_figures_and_every_sample_on_the_timeline(
    browser: Any, served: Served, shots: Path
) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{served.url}/r/{RID}")
    expected = _summary(served, RID)
    assert _figure(browser, "n_samples") == str(expected["n_samples"])
    assert _figure(browser, "kept") == str(expected["kept"])
    for name, count in expected["counts"].items():
        assert _figure(browser, f"counts.{name}") == str(count)
    for name, ds in expected["datasets"].items():
        for key, value in ds["metrics"].items():
            assert _figure(browser, f"{name}.{key}") == f"{key}={value:.6g}"
    spans = browser.find_elements(By.CSS_SELECTOR, "svg.timeline rect[data-s]")
    assert {s.get_attribute("data-s") for s in spans} == {
        t["sample_id"] for t in expected["tasks"]
    }
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.timeline rect.retry")) == 7
    assert browser.find_elements(By.CSS_SELECTOR, "svg.timeline rect.band-quiesce")
    browser.set_window_size(1300, 1900)
    browser.save_screenshot(str(shots / "rollout.png"))
    browser.set_window_size(1300, 1100)
    browser.get(f"{served.url}/")
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-rollout="{RID}"]')
    assert row.find_element(By.CSS_SELECTOR, '[data-k="aborted"]').text == str(
        expected["counts"]["infra_sandbox"]
    )
    browser.set_window_size(1300, 260)
    browser.save_screenshot(str(shots / "rollouts.png"))
    browser.set_window_size(1300, 1100)


def test_planted_markup_shows_as_text_and_never_runs(
    browser: Any, served: Served, shots: Path
) -> None:
    from selenium.webdriver.common.by import By

    for sample in ("s0", "s1", "s2", "s7"):  # the response, prompt, tool call, abort error
        browser.get(f"{served.url}/r/{RID}/s/{RID}:{sample}")
        assert browser.execute_script("return window.__pwned === undefined")
        assert not browser.find_elements(By.CSS_SELECTOR, "main img, main script")
        assert "<script>window.__pwned = 1</script>" in browser.find_element(
            By.TAG_NAME, "main"
        ).get_attribute("textContent")
    browser.get(f"{served.url}/r/{RID}/s/{RID}:s0")
    tokens = browser.find_elements(By.CSS_SELECTOR, ".tokens span")
    assert len(tokens) == 300
    browser.save_screenshot(str(shots / "sample.png"))
    browser.get(f"{served.url}/r/{RID}")
    browser.find_element(By.CSS_SELECTOR, ".pool-at a:nth-of-type(3)").click()
    _wait(lambda: "/pool?at=" in browser.current_url, "the pool page")
    assert "1 batch holding 1 token" in browser.find_element(By.TAG_NAME, "pre").text
    browser.set_window_size(1300, 420)
    browser.save_screenshot(str(shots / "pool.png"))
    browser.set_window_size(1300, 1100)
    browser.get(f"{served.url}/compare?a={RID}/{RID}:s4&b={RID}/{RID}:s5")
    assert len(browser.find_elements(By.CSS_SELECTOR, ".compare .col")) == 2
    browser.save_screenshot(str(shots / "compare.png"))


def test_a_timeline_span_opens_its_sample(browser: Any, served: Served) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{served.url}/r/{RID}")
    span = browser.find_element(By.CSS_SELECTOR, f'svg.timeline rect[data-s="{RID}:s9"]')
    browser.execute_script(
        "arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", span
    )
    _wait(lambda: browser.current_url.endswith(f"/r/{RID}/s/{RID}%3As9"), "the sample page")
    assert _figure(browser, "sample_id") == f"{RID}:s9"


def test_a_live_page_follows_the_rollout_without_a_reload(
    browser: Any, served: Served
) -> None:
    from selenium.webdriver.common.by import By

    events = synthetic_rollout("it4-live", 16, ready=False, t0_ms=1_700_000_500_000)
    first = [e for e in events if e[1].type in ("RolloutRequested", "TaskFetched")]
    served.write(first)
    browser.get(f"{served.url}/r/it4-live")
    browser.execute_script("window.__same_document = true")
    assert _figure(browser, "counts.success") == "0"
    assert not browser.find_elements(By.CSS_SELECTOR, "svg.timeline rect[data-s]")
    served.write([e for e in events if e not in first])
    expected = _summary(served, "it4-live")
    _wait(lambda: _figure(browser, "counts.success") == str(expected["counts"]["success"]),
          "the live update")
    assert browser.execute_script("return window.__same_document === true")
    spans = browser.find_elements(By.CSS_SELECTOR, "svg.timeline rect[data-s]")
    assert {s.get_attribute("data-s") for s in spans} == {
        t["sample_id"] for t in expected["tasks"]
    }
    assert re.fullmatch(r"\d+", browser.find_element(By.TAG_NAME, "body")
                        .get_attribute("data-updates") or "")
