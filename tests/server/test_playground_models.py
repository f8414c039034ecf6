"""The playground follows the models served (`mstar serve orpheus llama`, in headless Chromium): it opens on Speak
with the model that speaks (not `llama`, whose voice list would be empty), each tab offers only the models that
serve it, a tab no model serves is disabled, and a field shows only for a model that takes it (no Speed for Orpheus,
which refuses it; no spoken-reply box for a model without voices)."""

from __future__ import annotations

import shutil

import pytest

from tests.server.helpers import Server
from tests.server.test_playground import ARGS, CHROMIUM, WAIT_MS

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"no {CHROMIUM} (apt-get install chromium)")


@pytest.fixture(scope="module")
def page():
    pytest.importorskip("mstar_llm")
    srv = Server(["orpheus", "llama"], api_key=None, plugins=(), wait=False)
    try:
        srv.wait_ready(300)
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.problems = []
                page.on("console", lambda m: m.type == "error" and page.problems.append(m.text))
                page.on("pageerror", lambda e: page.problems.append(str(e)))
                page.goto(srv.url + "/")
                page.wait_for_function("document.getElementById('model-info').textContent.includes('routes:')")
                yield page
            finally:
                browser.close()
    finally:
        srv.stop()


def _options(page, select: str) -> list[str]:
    return page.eval_on_selector_all(f"{select} option", "os => os.map(o => o.value)")


def _visible(page, control: str) -> bool:
    """Whether the label holding `control` is shown."""
    return page.eval_on_selector(control, "el => !el.closest('label').hidden && el.closest('label').offsetParent !== null")


def test_opens_on_speak_with_the_model_that_speaks(page):
    assert page.eval_on_selector("#tabs button.active", "b => b.dataset.tab") == "speak"
    assert _options(page, "#model") == ["orpheus"] and page.input_value("#model") == "orpheus"
    voices = _options(page, "#speech-voice")
    assert voices and voices[0] == "tara"
    assert not _visible(page, "#speech-speed")  # Orpheus refuses speed: no field for it
    assert _visible(page, "#speech-seed") and _visible(page, "#speech-voice")
    assert page.problems == []


def test_each_tab_offers_the_models_that_serve_it(page):
    disabled = page.eval_on_selector_all("#tabs button", "bs => Object.fromEntries(bs.map(b => [b.dataset.tab, b.disabled]))")
    assert disabled == {"speak": False, "images": True, "video": True, "chat": False, "policy": True, "walks": False}
    page.click("#tabs button[data-tab=chat]")
    assert _options(page, "#model") == ["llama"] and page.input_value("#model") == "llama"
    assert not _visible(page, "#chat-spoken")  # llama has no voices
    page.fill("#chat-input", "Hello")
    page.fill("#chat-max", "4")
    page.click("#chat-go")
    page.wait_for_selector(".msg.answer", timeout=WAIT_MS)
    page.click("#tabs button[data-tab=walks]")
    assert sorted(_options(page, "#model")) == ["llama", "orpheus"]
    page.click("#tabs button[data-tab=speak]")
    assert _options(page, "#model") == ["orpheus"]
    assert page.problems == []
