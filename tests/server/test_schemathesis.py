"""schemathesis against the served /openapi.json: generated requests, zero 5xx (checked by schemathesis and by
the server's own request counter). The quick form runs in CI; the slow form sends well over 1,000 requests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.helpers import metric

ST = str(Path(sys.executable).parent / "st")


def _requests(server) -> tuple[float, float]:
    text_total = metric(server, "mstar_requests_total")
    fives = sum(metric(server, "mstar_requests_total", status=str(code)) for code in (500, 501, 502, 503, 504))
    return text_total, fives


def run_schemathesis(server, max_examples: int, minimum: int) -> None:
    before, fives_before = _requests(server)
    cmd = [ST, "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error",
           "--max-examples", str(max_examples), "--phases", "examples,coverage,fuzzing", "--workers", "1",
           "--suppress-health-check", "all", "--header", f"Authorization: Bearer {server.api_key}",
           "--request-timeout", "30", "--seed", "1234"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    report = out.stdout + out.stderr
    assert "not_a_server_error" not in report and "Server error" not in report, report[-4000:]
    assert " failed" not in report.split("Test cases:")[-1], report[-4000:]
    after, fives_after = _requests(server)
    assert after - before >= minimum, f"only {after - before} requests reached the server\n{report[-2000:]}"
    assert fives_after == fives_before, f"server answered {fives_after - fives_before} 5xx"
    print(f"schemathesis: {after - before:.0f} requests reached the server, 0 answered 5xx")


def test_schemathesis_quick(server):
    run_schemathesis(server, max_examples=8, minimum=300)


@pytest.mark.slow
def test_schemathesis_thousand_requests(server):
    run_schemathesis(server, max_examples=200, minimum=1000)
