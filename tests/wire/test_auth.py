"""HMAC-authenticated Hello/Welcome: the right secret joins; wrong secret, replay and staleness are refused."""

from __future__ import annotations

import attrs
import pytest

from mstar_core.wire import AuthError, decode, encode
from mstar_core.wire.auth import HelloVerifier, make_hello, secret_from_env, verify_welcome

SECRET = b"correct horse battery staple"


def test_signed_hello_over_the_wire_is_accepted_and_welcome_verifies():
    hello = decode(encode(make_hello(SECRET, "w0")))
    v = HelloVerifier(SECRET)
    v.verify(hello)
    welcome = decode(encode(v.welcome(hello, session="s1", heartbeat_interval=0.5)))
    verify_welcome(SECRET, hello, welcome)


def test_wrong_secret_is_refused():
    with pytest.raises(AuthError, match="wrong shared secret"):
        HelloVerifier(SECRET).verify(make_hello(b"not the secret at all", "intruder"))


def test_tampered_hello_is_refused():
    hello = attrs.evolve(make_hello(SECRET, "w0"), worker="w1")
    with pytest.raises(AuthError, match="wrong shared secret"):
        HelloVerifier(SECRET).verify(hello)


def test_replay_and_stale_hellos_are_refused():
    v = HelloVerifier(SECRET, max_skew_s=5)
    hello = make_hello(SECRET, "w0")
    v.verify(hello)
    with pytest.raises(AuthError, match="replayed"):
        v.verify(hello)
    old = make_hello(SECRET, "w0")
    from mstar_core.wire.auth import _hello_mac

    old = attrs.evolve(old, timestamp=old.timestamp - 60)
    old = attrs.evolve(old, mac=_hello_mac(SECRET, old))
    with pytest.raises(AuthError, match="stale"):
        v.verify(old)


def test_welcome_from_impostor_is_refused():
    hello = make_hello(SECRET, "w0")
    fake = HelloVerifier(b"impostor secret value").welcome(hello, session="s", heartbeat_interval=1.0)
    with pytest.raises(AuthError, match="coordinator failed authentication"):
        verify_welcome(SECRET, hello, fake)


def test_missing_secret_env_names_the_variable(monkeypatch):
    monkeypatch.delenv("MSTAR_SECRET", raising=False)
    with pytest.raises(AuthError, match="MSTAR_SECRET"):
        secret_from_env()
    monkeypatch.setenv("MSTAR_SECRET", "x" * 20)
    assert secret_from_env() == b"x" * 20
