"""The generic tokenizer adapter offers only the routes whose inputs the model's declared schema takes.

Orpheus has a tokenizer but takes `text`, not a `prompt`: offering /v1/completions for it gave every
completions request a 400 naming `prompt` (the 10-minute soak's only errors). A model that takes
`prompt` and `messages` (llama) keeps both routes; one without a schema keeps what its tokenizer allows.
"""

import pytest

from mstar_core.api.requests.chat_adapter import TokenizerChatAdapter
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover


@pytest.fixture(scope="module")
def registry():
    return discover()


@pytest.fixture(scope="module")
def llama(registry):
    pytest.importorskip("mstar_llm")
    return registry.models.get("llama").load(LoadOptions(preset="tiny"))


def test_orpheus_gets_no_generic_text_routes(registry):
    pytest.importorskip("mstar_orpheus")
    loaded = registry.models.get("orpheus").load(LoadOptions(preset="tiny"))
    assert "tokenizer" in loaded.extras and set(TokenizerChatAdapter("orpheus", loaded).routes) == set()


def test_llama_keeps_chat_and_completions(llama):
    assert set(TokenizerChatAdapter("llama", llama).routes) == {"chat", "completions"}


def test_without_a_schema_the_tokenizer_decides(llama):
    schema, llama.request_schema = llama.request_schema, None
    try:
        assert set(TokenizerChatAdapter("llama", llama).routes) == {"chat", "completions"}
    finally:
        llama.request_schema = schema
