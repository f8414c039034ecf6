"""Charts for `mstar bench serve --plot`: latency percentiles and throughput against concurrency.

matplotlib is not a runtime dependency; `require_matplotlib` says how to get it before a bench runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

INSTALL_HINT = "--plot needs matplotlib, which M* does not install: pip install matplotlib"


def require_matplotlib() -> str | None:
    """None when matplotlib imports, else the message to show."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    return None


def _series(reports: Sequence[dict[str, Any]], key: str, pct: str) -> list[float | None]:
    return [(r.get(key) or {}).get(pct) for r in reports]


def plot_sweep(reports: Sequence[dict[str, Any]], path: str | Path, title: str | None = None) -> Path:
    """Draw one report per concurrency level (each with `concurrency`) into `path` (format from its suffix)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    reports = sorted(reports, key=lambda r: r["concurrency"])
    xs = [r["concurrency"] for r in reports]
    speech = reports[0]["kind"] == "speech"
    first = "ttfa_s" if speech else "ttft_s"
    panels = [(first, "TTFA" if speech else "TTFT"), ("latency_s", "end-to-end latency")]
    if not speech:
        panels.append(("tpot_s", "time per output token"))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.2 * (len(panels) + 1), 3.6))
    for ax, (key, label) in zip(axes, panels, strict=False):
        for pct, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ys = [None if v is None else v * 1000 for v in _series(reports, key, pct)]
            pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=pct)
        ax.set_title(label)
        ax.set_ylabel("ms")
    tput_key, tput_label = ("audio_s_per_s", "audio-s / s") if speech else ("tokens_per_s", "tokens / s")
    axes[-1].plot(xs, [r.get(tput_key) or 0.0 for r in reports], "o-", color="tab:green")
    axes[-1].set_title("throughput")
    axes[-1].set_ylabel(tput_label)
    for ax in axes:
        ax.set_xlabel("concurrent requests")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    first_rep = reports[0]
    fig.suptitle(title or f"mstar bench serve: {first_rep['kind']} on {first_rep['model']}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
