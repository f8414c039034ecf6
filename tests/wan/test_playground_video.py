"""The playground's video tab in headless Chromium against `mstar serve wan --api-key ...`: the job's progress bar
moves and the finished MP4 plays in the page's <video> element."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.server.helpers import API_KEY, Server

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = os.environ.get("MSTAR_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--autoplay-policy=no-user-gesture-required"]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"no {CHROMIUM} (apt-get install chromium)")]


def test_the_video_tab_shows_progress_and_plays_the_result():
    server = Server(["wan"], api_key=API_KEY, plugins=(), wait=False)
    try:
        server.wait_ready(240)
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                page = browser.new_page()
                problems = []
                page.on("pageerror", lambda e: problems.append(str(e)))
                page.goto(server.url + "/")
                page.fill("#api-key", API_KEY)
                page.dispatch_event("#api-key", "change")
                page.wait_for_function("document.querySelectorAll('#model option').length === 1")
                page.click("#tabs button[data-tab=video]")
                page.fill("#video-steps", "3")
                page.click("#video-go")
                page.wait_for_function("document.getElementById('video-status').textContent.startsWith('completed')",
                                       timeout=120_000)
                assert page.eval_on_selector("#video-progress", "e => e.value") == 100
                # the MP4 decodes in the browser: it has a duration and the tiny preset's 32x64 frames
                page.wait_for_function("document.getElementById('video-result').readyState >= 1", timeout=30_000)
                size = page.eval_on_selector("#video-result", "v => [v.videoWidth, v.videoHeight, v.duration]")
                assert size[:2] == [32, 64] and size[2] > 3.5
                assert problems == []
            finally:
                browser.close()
    finally:
        server.stop()
