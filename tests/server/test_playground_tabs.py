"""The playground's tabs, read from its files without a browser: every tab button in index.html has its rule in
app.js's TABS (which models serve it) and its words in TAB_WORDS. A tab missing there stops the page from listing
any model (the browser tests catch that too, slowly)."""

from __future__ import annotations

import re
from pathlib import Path

PLAYGROUND = Path(__file__).resolve().parents[2] / "mstar_core" / "playground"


def _object_keys(source: str, name: str) -> set[str]:
    body = re.search(rf"const {name} = \{{(.*?)\n?\}};", source, re.S)
    assert body, f"app.js has no `const {name} = {{...}};`"
    return set(re.findall(r"(?:^|[,{\s])(\w+):", body.group(1)))


def test_every_tab_button_has_its_rule_and_words():
    buttons = set(re.findall(r'data-tab="(\w+)"', (PLAYGROUND / "index.html").read_text()))
    app = (PLAYGROUND / "app.js").read_text()
    assert buttons, "index.html has no tab buttons"
    assert buttons <= _object_keys(app, "TABS"), buttons - _object_keys(app, "TABS")
    assert buttons <= _object_keys(app, "TAB_WORDS"), buttons - _object_keys(app, "TAB_WORDS")
