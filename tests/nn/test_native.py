"""The CPU kernel builder: one build per source version and machine, reused, and nothing without a compiler."""

from __future__ import annotations

import logging
import shutil

import pytest

from mstar_core.nn import native

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")


def _source(folder, value):
    path = folder / "answer.cpp"
    path.write_text(f'extern "C" int answer() {{ return {value}; }}\n')
    return path


def test_builds_once_then_loads_the_cached_library_and_drops_stale_versions(tmp_path, monkeypatch):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    source = _source(tmp_path, 41)
    assert native.load(source, "native").answer() == 41
    (first,) = (tmp_path / "cache").glob("answer-native-*.so")
    monkeypatch.setattr(native, "_loaded", {})  # a new process: the cached file is loaded, not rebuilt
    built = first.stat().st_mtime_ns
    assert native.load(source, "native").answer() == 41 and first.stat().st_mtime_ns == built
    monkeypatch.setattr(native, "_loaded", {})
    _source(tmp_path, 42)  # a new version of the source: a new build, and the old one is removed
    assert native.load(source, "native").answer() == 42
    (second,) = (tmp_path / "cache").glob("answer-native-*.so")
    assert second != first


def test_a_source_that_does_not_compile_gives_none_and_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with caplog.at_level(logging.WARNING, logger="mstar.nn.native"):
        assert native.load(broken, "native") is None
    assert any("broken not built" in r.message for r in caplog.records)
    assert not list((tmp_path / "cache").glob("*.so"))


def test_function_sets_the_signature_once_and_is_none_without_a_library(tmp_path, monkeypatch):
    import ctypes

    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    source = _source(tmp_path, 7)
    fn = native.function(source, "answer", [], ctypes.c_int, "native")
    assert fn() == 7 and fn.restype is ctypes.c_int
    assert native.function(source, "answer", [], ctypes.c_int, "native") is fn
    monkeypatch.setenv(native.SWITCH_ENV, "0")
    assert native.function(source, "answer", [], ctypes.c_int) is None
