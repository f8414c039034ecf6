"""The Responses API's stored state bounded (issue 50, item 8): the store by bytes as well as count, `metadata` to
OpenAI's limits and `user` bounded (a 400 naming the field), `text.format` as anything but an object a 400."""

from __future__ import annotations

import pytest

from mstar_core.api.http.errors import ApiError
from mstar_core.api.requests.response_items import check_stored_fields, text_format
from mstar_core.api.requests.response_store import ResponseStore


def _response(rid: str, text: str) -> dict:
    return {"id": rid, "object": "response", "output": [{"type": "message", "content": [{"text": text}]}]}


def test_the_store_is_bounded_in_bytes_oldest_dropped_first():
    store = ResponseStore(max_items=1000, max_bytes=50_000)
    for i in range(10):
        assert store.put(_response(f"r{i}", "x" * 10_000), [{"role": "user", "content": "y" * 100}])
        assert store.bytes <= 50_000
    assert len(store) == 4  # each ~10.2 KB
    assert store.get("r0") is None and store.get("r9") is not None
    assert not store.put(_response("huge", "x" * 60_000), [])  # larger than the whole bound: not kept
    assert store.get("huge") is None and len(store) == 4
    assert store.delete("r9") and store.bytes == sum(s.size for s in store._items.values())
    store.put(_response("r8", "short"), [])  # put again under the same id: counted once
    assert store.bytes == sum(s.size for s in store._items.values())


def test_the_store_keeps_its_count_bound():
    store = ResponseStore(max_items=3, max_bytes=10**9)
    for i in range(5):
        store.put(_response(f"r{i}", "a"), [])
    assert len(store) == 3 and store.get("r1") is None


@pytest.mark.parametrize(("metadata", "user", "param"), [
    ({f"k{i}": "v" for i in range(17)}, None, "metadata"),
    ({"k" * 65: "v"}, None, "metadata"),
    ({"key": "v" * 513}, None, "metadata.key"),
    ({"key": 5}, None, "metadata.key"),
    ({"key": "v"}, "u" * 257, "user"),
])
def test_metadata_and_user_out_of_bounds_are_400s_naming_the_field(metadata, user, param):
    with pytest.raises(ApiError) as err:
        check_stored_fields(metadata, user)
    assert err.value.status == 400 and err.value.param == param


def test_metadata_within_openais_limits_passes():
    check_stored_fields({f"k{i}": "v" * 512 for i in range(16)} | {}, "user-1")
    check_stored_fields({"k" * 64: ""}, None)
    check_stored_fields(None, None)


@pytest.mark.parametrize("fmt", ["json_schema", ["json_schema"], 3])
def test_text_format_that_is_not_an_object_is_a_400(fmt):
    with pytest.raises(ApiError) as err:
        text_format({"format": fmt})
    assert err.value.status == 400 and err.value.param == "text.format"


def test_text_format_objects_still_read():
    assert text_format(None) is None and text_format({}) is None
    assert text_format({"format": {"type": "text"}}) == {"type": "text"}
    assert text_format({"format": {"type": "json_schema", "name": "x", "schema": {}}}) == {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {}}}


def test_grammar_and_media_limits_read_numbers_by_one_rule(monkeypatch):
    """`mstar_core.strict.positive_number` is the one rule: a bad MSTAR_GRAMMAR_* value is a ConfigError naming the
    variable, as a bad MSTAR_MEDIA_* one is."""
    from mstar_core.api.media.limits import MediaLimits
    from mstar_core.errors import ConfigError
    from mstar_core.grammar import limits

    monkeypatch.setenv("MSTAR_GRAMMAR_WORKERS", "0")
    with pytest.raises(ConfigError, match="MSTAR_GRAMMAR_WORKERS must be positive"):
        limits.compile_workers()
    monkeypatch.setenv("MSTAR_GRAMMAR_WORKERS", "two")
    with pytest.raises(ConfigError, match="MSTAR_GRAMMAR_WORKERS must be a number"):
        limits.compile_workers()
    monkeypatch.setenv("MSTAR_GRAMMAR_WORKERS", "3")
    assert limits.compile_workers() == 3
    monkeypatch.delenv("MSTAR_GRAMMAR_WORKERS")
    assert limits.compile_workers() == 2
    from mstar_core.api.realtime.limits import RealtimeLimits

    with pytest.raises(ConfigError, match="MSTAR_REALTIME_MAX_SESSIONS must be positive"):
        RealtimeLimits.from_env({"MSTAR_REALTIME_MAX_SESSIONS": "-1"})
    assert MediaLimits().with_env({"MSTAR_MEDIA_MAX_PARTS": "3"}).max_parts == 3
