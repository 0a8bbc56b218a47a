"""The status page (swarmd/api/page.html) in a real headless Chromium, driven over the Chrome
DevTools Protocol (aiohttp's websocket client, no extra packages).

Without chromium the test is skipped, unless ``CI`` is set: then it fails (tools/setup.sh --test
installs chromium when ``CI`` or ``SWARMD_BROWSER_TESTS=1`` is set). Set
``SWARMD_SCREENSHOT_DIR`` to keep the screenshots (page.png, page-unreachable.png).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from test_http_api import (ME, TRAINER, FakeDaemon, peer_id, run, sample_status, serving)

from swarmd.api.types import StatusInfo, to_json

pytestmark = pytest.mark.integration

STARTUP_DEADLINE_S = 60.0
WAIT_DEADLINE_S = 15.0
WIDTH, HEIGHT = 1280, 800


def chromium_path() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    how = ("install it with `apt-get install -y chromium`, or run tools/setup.sh --test with "
           "SWARMD_BROWSER_TESTS=1")
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but chromium is not installed, so the page's browser test "
                    f"cannot run: {how}")
    pytest.skip(f"chromium is not installed (the page's browser test needs it): {how}")


# ---------------------------------------------------------------------------------- browser

@contextlib.asynccontextmanager
async def chromium(tmp_path: Path) -> AsyncIterator[int]:
    """A headless Chromium on an empty profile; yields its DevTools port; killed on exit."""
    exe = chromium_path()
    profile = tmp_path / "profile"
    profile.mkdir()
    stderr = (tmp_path / "chromium.stderr").open("wb")
    proc = await asyncio.create_subprocess_exec(
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--disable-extensions", "--mute-audio",
        f"--window-size={WIDTH},{HEIGHT}", f"--user-data-dir={profile}",
        "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "about:blank",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=stderr)
    try:
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while not (active.exists() and active.read_text().count("\n") >= 1):
            if proc.returncode is not None:
                pytest.fail(f"chromium exited with {proc.returncode}: "
                            f"{(tmp_path / 'chromium.stderr').read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"chromium did not open its DevTools port within "
                            f"{STARTUP_DEADLINE_S:g} s")
            await asyncio.sleep(0.05)
        yield int(active.read_text().splitlines()[0])
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        stderr.close()


class Cdp:
    """One page target of Chrome DevTools Protocol: calls with deadlines, events recorded."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []

    async def read_forever(self) -> None:
        async for message in self.ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(message.data)
            if "id" in data:
                future = self.pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
            else:
                self.events.append(data)
        for future in self.pending.values():
            if not future.done():
                future.set_exception(ConnectionError("DevTools connection closed"))

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self.ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[call_id] = future
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        async with asyncio.timeout(WAIT_DEADLINE_S):
            reply = await future
        if "error" in reply:
            raise AssertionError(f"{method} failed: {reply['error']}")
        return reply["result"]

    async def eval(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_until(self, expression: str, what: str) -> Any:
        deadline = time.monotonic() + WAIT_DEADLINE_S
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"the page did not show {what} within {WAIT_DEADLINE_S:g} s")
            await asyncio.sleep(0.05)

    async def screenshot(self, path: Path) -> Path:
        data = (await self.call("Page.captureScreenshot", format="png"))["data"]
        path.write_bytes(base64.b64decode(data))
        keep = os.environ.get("SWARMD_SCREENSHOT_DIR")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(keep) / path.name)
        return path

    def problems(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions, failed loads (favicon included)."""
        found = []
        for event in self.events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(f"uncaught: {params['exceptionDetails']}")
            elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "warning",
                                                                           "assert"):
                found.append(f"console.{params['type']}: {params['args']}")
            elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
                entry = params["entry"]
                found.append(f"log {entry['level']} ({entry['source']}): {entry['text']} "
                             f"{entry.get('url', '')}")
        return found


@contextlib.asynccontextmanager
async def devtools_page(port: int) -> AsyncIterator[Cdp]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_DEADLINE_S)) as s:
        async with s.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t["type"] == "page")
        async with s.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            cdp = Cdp(ws)
            reader = asyncio.create_task(cdp.read_forever())
            try:
                await cdp.call("Runtime.enable")
                await cdp.call("Log.enable")
                await cdp.call("Page.enable")
                await cdp.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT,
                               deviceScaleFactor=1, mobile=False)
                yield cdp
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader


# ------------------------------------------------------------------------------------- test

SUMMARY = """(() => {
  const stages = [...document.querySelectorAll('#pipeline .stage')];
  const slow = document.querySelector('#pipeline .stage.bottleneck');
  const fast = document.querySelector('#pipeline .stage:not(.bottleneck)');
  return {
    stages: stages.map((s) => s.dataset.stage),
    lefts: stages.map((s) => s.getBoundingClientRect().left),
    tops: stages.map((s) => Math.round(s.getBoundingClientRect().top)),
    rights: stages.map((s) => s.getBoundingClientRect().right),
    peers: stages.map((s) => [...s.querySelectorAll('.peer')].map((p) => p.dataset.peer)),
    bars: stages.map((s) => parseFloat(s.querySelector('.bar .fill').style.width)),
    bottleneck: [...document.querySelectorAll('#pipeline .stage.bottleneck')]
                  .map((s) => s.dataset.stage),
    badge: slow && slow.querySelector('.badge').textContent,
    slowBorder: slow && getComputedStyle(slow).borderTopColor,
    fastBorder: fast && getComputedStyle(fast).borderTopColor,
    unroutable: [...document.querySelectorAll('.peer.unroutable')].map((p) => p.textContent),
    excludedShown: !document.getElementById('excluded-section').hidden,
    excluded: [...document.querySelectorAll('#excluded tr')].map((r) => r.textContent),
    peerId: document.getElementById('peer-id').title,
    state: document.getElementById('state').textContent,
    stage: document.getElementById('stage').textContent,
    uptime: document.getElementById('uptime').textContent,
    updated: document.getElementById('updated').textContent,
    bannerHidden: document.getElementById('banner').hidden,
    scrollWidth: document.documentElement.scrollWidth,
    dotColours: Object.fromEntries([...document.querySelectorAll('.peer')].map(
      (p) => [p.dataset.peer, getComputedStyle(p.querySelector('.dot')).backgroundColor])),
    trainingShown: !document.getElementById('training-section').hidden,
    trainers: [...document.querySelectorAll('#trainers .trainer')].map((t) => ({
      peer: t.dataset.peer, text: t.textContent,
      train: t.querySelectorAll('svg path.train').length,
      trainPoints: (t.querySelector('svg path.train').getAttribute('d')
                    .match(/[ML]/g) || []).length,
      valDots: t.querySelectorAll('svg circle.val-dot').length,
      width: t.querySelector('svg').getBoundingClientRect().width,
    })),
  };
})()"""


def test_page_renders_the_pipeline_refreshes_and_reports_an_unreachable_daemon(
        tmp_path: Path) -> None:
    chromium_path()  # skip or fail before anything starts
    fake = FakeDaemon()

    async def body() -> None:
        async with chromium(tmp_path) as port, devtools_page(port) as cdp:
            async with serving(fake) as http:
                await cdp.call("Page.navigate", url=http.url + "/")
                await cdp.wait_until("document.querySelectorAll('#pipeline .stage').length === 3",
                                     "three stages")
                page = await cdp.eval(SUMMARY)

                assert page["stages"] == ["0", "1", "2"]
                # side by side, left to right, on one row, inside the window
                assert page["lefts"] == sorted(page["lefts"]) and len(set(page["lefts"])) == 3
                assert len(set(page["tops"])) == 1
                assert max(page["rights"]) <= WIDTH and page["scrollWidth"] <= WIDTH
                assert page["peers"] == [[peer_id(2), peer_id(3)], [peer_id(1), peer_id(4)],
                                         [peer_id(5), peer_id(6)]]
                # bars scaled to the fastest stage's total (40.5)
                assert page["bars"] == pytest.approx([100.0, 100 * 11.25 / 40.5,
                                                      100 * 30.0 / 40.5], abs=0.01)
                # state colours: online peers share one, joining and migrating differ from it
                dots = page["dotColours"]
                assert dots[peer_id(2)] == dots[peer_id(5)]
                assert len({dots[peer_id(2)], dots[peer_id(4)], dots[peer_id(6)]}) == 3
                assert page["bottleneck"] == ["1"]
                assert page["badge"].lower() == "bottleneck"
                assert page["slowBorder"] != page["fastBorder"]
                assert any("moving to stage 1" in text for text in page["unroutable"])
                assert page["excludedShown"] and len(page["excluded"]) == 1
                assert "this swarm trains gpt-tiny" in page["excluded"][0]
                assert (page["peerId"], page["state"], page["stage"]) == (ME, "online", "1")
                assert page["uptime"] == "1h 02m 03s"
                assert page["updated"].startswith("last updated ")
                assert page["bannerHidden"]
                # each trainer's loss curves: one line of its steps, a dot per validation
                assert page["trainingShown"]
                (trainer,) = page["trainers"]
                assert trainer["peer"] == TRAINER
                assert "shard 1/2" in trainer["text"] and "2.0000" in trainer["text"]
                assert "3.9000" in trainer["text"] and "(step 30)" in trainer["text"]
                assert (trainer["train"], trainer["trainPoints"], trainer["valDots"]) == (1, 40, 4)
                assert trainer["width"] > 200
                await cdp.screenshot(tmp_path / "page.png")

                # it polls: a change in the daemon shows up without reloading
                fake.status_value = StatusInfo(**{**to_json(sample_status()),
                                                  "state": "migrating"})
                await cdp.wait_until("document.getElementById('state').textContent === "
                                     "'migrating'", "the new state after a refresh")
                assert fake.calls["swarm"] >= 2
                assert cdp.problems() == []

            # the daemon is gone: a visible banner, the last data kept
            await cdp.wait_until("!document.getElementById('banner').hidden && "
                                 "document.getElementById('banner').textContent"
                                 ".includes('unreachable')", "the unreachable banner")
            assert await cdp.eval("document.querySelectorAll('#pipeline .stage').length") == 3
            visible = await cdp.eval("(() => { const r = document.getElementById('banner')"
                                     ".getBoundingClientRect(); return r.height > 0 && "
                                     "r.top >= 0 && r.top < innerHeight; })()")
            assert visible
            await cdp.screenshot(tmp_path / "page-unreachable.png")
            # only the failed fetches themselves, no script errors
            assert all("ERR_CONNECTION_REFUSED" in p or "Failed to fetch" in p
                       for p in cdp.problems()), cdp.problems()

    run(body, deadline=120)
