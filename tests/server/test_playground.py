"""The playground at `/` in headless Chromium (Debian's `chromium`, driven by Playwright) against a real
`mstar serve orpheus bagel pi05 --api-key ...` on loopback: the page loads without console errors, speech plays,
an image appears, a chat answer appears, the walks are drawn, a policy gives its action chunk, and a bad input
shows the API's own message. Screenshots are kept under `tmp/artefacts/` (or $MSTAR_ARTEFACTS)."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import httpx
import pytest

from tests.server.helpers import API_KEY, Server

sync_api = pytest.importorskip("playwright.sync_api")
Image = pytest.importorskip("PIL.Image")
CHROMIUM = os.environ.get("MSTAR_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTEFACTS = Path(os.environ.get("MSTAR_ARTEFACTS", Path(__file__).resolve().parents[2] / "tmp" / "artefacts"))
pytestmark = pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"no {CHROMIUM} (apt-get install chromium)")
WAIT_MS = 240_000


@pytest.fixture(scope="module")
def server():
    srv = Server(["orpheus", "bagel", "pi05"], api_key=API_KEY, plugins=(), wait=False)
    try:
        srv.wait_ready(300)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def page(server):
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.problems = []
            page.on("console", lambda m: m.type == "error" and page.problems.append(m.text))
            page.on("pageerror", lambda e: page.problems.append(str(e)))
            page.goto(server.url + "/")
            page.wait_for_function("document.getElementById('model-info').textContent.includes('API key')")
            page.fill("#api-key", API_KEY)
            page.dispatch_event("#api-key", "change")
            # the Speak tab (opened first) offers the one model that speaks
            page.wait_for_function("document.getElementById('model-info').textContent.includes('routes:')")
            yield page
        finally:
            browser.close()


def _shot(page, name: str) -> None:
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTEFACTS / f"playground-{name}.png"), full_page=True)


def test_the_page_is_served_without_the_key_and_the_api_still_needs_it(server):
    assert httpx.get(server.url + "/").status_code == 200
    assert "M* playground" in httpx.get(server.url + "/").text
    assert httpx.get(server.url + "/playground/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/graphs/orpheus").status_code == 401


def test_the_page_loads_without_console_errors(page):
    assert page.problems == []  # asked for the key first (no 401), models listed with it
    assert "routes:" in page.inner_text("#model-info")


def test_speech_plays(page):
    page.click("#tabs button[data-tab=speak]")  # first: each tab offers only the models that serve it
    page.select_option("#model", "orpheus")
    page.fill("#speech-input", "Hi there.")
    page.fill("#speech-seed", "1")
    page.click("#speech-go")
    page.wait_for_function("document.getElementById('speech-audio').duration > 0", timeout=WAIT_MS)
    duration = page.evaluate("document.getElementById('speech-audio').duration")
    assert duration > 0 and page.is_hidden("#error")
    assert "first audio after" in page.inner_text("#speech-status")
    _shot(page, "speech")


def test_a_bad_input_shows_the_apis_message(page, server):
    page.click("#tabs button[data-tab=speak]")  # first: each tab offers only the models that serve it
    page.select_option("#model", "orpheus")
    page.fill("#speech-input", "")
    page.click("#speech-go")
    page.wait_for_selector("#error:not([hidden])", timeout=WAIT_MS)
    body = {"model": "orpheus", "input": "", "voice": "tara", "response_format": "wav"}
    api = httpx.post(server.url + "/v1/audio/speech", json=body, headers=server.headers).json()["error"]
    assert page.inner_text("#error") == f"{api['message']} (param: {api['param']})"
    _shot(page, "error")


def test_an_image_appears(page):
    page.click("#tabs button[data-tab=images]")  # first: each tab offers only the models that serve it
    page.select_option("#model", "bagel")
    assert page.input_value("#image-size") == "256x256"  # the model's default size, from /v1/models
    page.fill("#image-n", "2")
    page.fill("#image-seed", "5")
    page.fill("#image-steps", "2")
    page.click("#image-go")
    page.wait_for_function("[...document.querySelectorAll('img.generated')].filter(i => i.naturalWidth === 256)"
                           ".length === 2", timeout=WAIT_MS)
    captions = page.locator("#image-results figcaption").all_inner_texts()
    assert captions == ["seed 5, 256x256", "seed 6, 256x256"]
    _shot(page, "images")


def test_a_chat_answer_about_an_image_appears(page, tmp_path):
    png = tmp_path / "red.png"
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 10)).save(buf, format="PNG")
    png.write_bytes(buf.getvalue())
    page.click("#tabs button[data-tab=chat]")  # first: each tab offers only the models that serve it
    page.select_option("#model", "bagel")
    page.fill("#chat-input", "What is this?")
    page.set_input_files("#chat-image", str(png))
    page.fill("#chat-max", "4")
    page.click("#chat-go")
    answer = page.wait_for_selector(".msg.answer", timeout=WAIT_MS)
    usage = answer.inner_text().split("usage: ")[1]
    assert int(usage.split(" prompt")[0]) > 10  # the image's block counts, not only the words
    _shot(page, "chat")


def test_a_policy_gives_its_action_chunk(page):
    page.click("#tabs button[data-tab=policy]")  # first: each tab offers only the models that serve it
    page.select_option("#model", "pi05")
    page.click("#policy-sample")
    page.wait_for_function("document.getElementById('policy-input').value.includes('prompt')", timeout=WAIT_MS)
    page.click("#policy-go")
    title = page.wait_for_selector("#policy-result h4", timeout=WAIT_MS).inner_text()
    assert "actions" in page.inner_text("#policy-result") and "float32" in title
    _shot(page, "policy")


def test_walks_are_drawn_and_no_console_errors(page):
    page.click("#tabs button[data-tab=walks]")  # first: each tab offers only the models that serve it
    page.select_option("#model", "bagel")
    page.wait_for_selector("#walks .walk svg rect", timeout=WAIT_MS)
    # (the tab opened on the first model that serves it: its drawing can still be there when bagel's request leaves,
    # so wait for bagel's walks to replace it rather than count the first drawing seen)
    page.wait_for_function("document.querySelectorAll('#walks .walk').length >= 4", timeout=WAIT_MS)
    assert page.locator("#walks .walk svg rect").count() >= 4
    _shot(page, "walks")
    # the only console line since loading: Chromium's note on the bad input's 400 (no script error anywhere)
    assert [p for p in page.problems if "status of 400" not in p] == []
