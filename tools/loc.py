"""Lines of code per area of the repository: the figures README.md and docs/*.md quote, from one place.

    python tools/loc.py                  every area, as a Markdown table
    python tools/loc.py api cluster      only those areas
    python tools/loc.py --write          refresh every figures block in README.md and docs/*.md in place
    python tools/loc.py --check          exit 1 naming each quoted figure more than 10 % off the tree

A figures block in a document is the table this command prints for the areas named in its opening comment:

    <!-- figures: python tools/loc.py api cluster -->
    | area | counts | files | lines |
    ...
    <!-- /figures -->

A line is a physical line (what `wc -l` counts: blanks, comments and docstrings included), of shipped source only:
no file under a `tests/` directory counts. tests/docs/test_figures.py (run by CI) fails when a quoted figure is more
than 10 % off the tree, and says to run `--write`. Standard library only, so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.10
DOCUMENTS = ("README.md", "docs/*.md")
MODEL_PACKAGES = ("mstar_llm", "mstar_orpheus", "mstar_pi05", "mstar_qwen_omni", "mstar_qwen_tts", "mstar_vjepa",
                  "mstar_bagel", "mstar_wan", "mstar_whisper")


@dataclass(frozen=True)
class Area:
    name: str
    counts: str  # what it counts, in words, for the table
    patterns: tuple[str, ...]  # globs relative to the repository root


def _core(*names: str) -> tuple[str, ...]:
    """Globs for `mstar_core` modules (`x.py`) and packages (`x`, every .py below it)."""
    return tuple(f"mstar_core/{n}" if n.endswith(".py") else f"mstar_core/{n}/**/*.py" for n in names)


# The rows, in the order of the layers (surfaces first, the kernel last; then plugins and model packages). Globs
# reach into subdirectories, so a package that is split into folders keeps its row.
AREAS: tuple[Area, ...] = (
    Area("api", "`mstar_core/api/`: the HTTP surface", _core("api")),
    Area("cli", "`mstar_core/`: `cli.py`, `bench/`, `openmp.py`", _core("cli.py", "bench", "openmp.py")),
    Area("playground", "the playground's JavaScript, HTML and CSS",
         ("mstar_core/**/*.js", "mstar_core/**/*.html", "mstar_core/**/*.css")),
    Area("cluster", "`mstar_core/cluster/`: the multi-process runtime", _core("cluster")),
    Area("runtime", "`mstar_core/runtime/`: the in-process runtime", _core("runtime")),
    Area("nn", "`mstar_core/nn/`: the model-building library (Python)", _core("nn")),
    Area("cpp", "C++ kernels (`mstar_core/nn/`, `plugins/mstar-attn-torch/`)",
         ("mstar_core/**/*.cpp", "mstar_core/**/*.h", "plugins/*/src/**/*.cpp", "plugins/*/src/**/*.h")),
    Area("loading", "`mstar_core/`: `model.py`, `checkpoint/`, `config/`", _core("model.py", "checkpoint", "config")),
    Area("kernel", "`mstar_core/`: `graph/`, `streaming/`, `schema.py`, `plugins/`, `wire/`, `errors.py`",
         _core("graph", "streaming", "schema.py", "plugins", "wire", "errors.py")),
    Area("leaves", "`mstar_core/`: `sampling.py`, `grammar/`, `strict.py`, `compat.py`",
         _core("sampling.py", "grammar", "strict.py", "compat.py")),
    Area("mstar_core", "all of `mstar_core/` (Python)", ("mstar_core/**/*.py",)),
    Area("kvcache", "`plugins/mstar-kvcache/`: the paged-KV engine", ("plugins/mstar-kvcache/src/**/*.py",)),
    Area("engines", "`plugins/`: the three engines", tuple(
        f"plugins/mstar-{e}/src/**/*.py" for e in ("kvcache", "stateless", "diffusion"))),
    Area("transports", "`plugins/mstar-transport-*`", ("plugins/mstar-transport-*/src/**/*.py",)),
    Area("attention", "`plugins/mstar-attn-*` (Python)", ("plugins/mstar-attn-*/src/**/*.py",)),
    *(Area(p, f"`{p}/`", (f"{p}/src/**/*.py",)) for p in MODEL_PACKAGES),
    Area("models", "the six model packages", tuple(f"{p}/src/**/*.py" for p in MODEL_PACKAGES)),
    Area("shipped", "`mstar_core`, plugins and model packages (Python)",
         ("mstar_core/**/*.py", "plugins/*/src/**/*.py", *(f"{p}/src/**/*.py" for p in MODEL_PACKAGES))),
    Area("examples", "`examples/` (Python)", ("examples/**/*.py",)),
    Area("benchmarks", "`benchmarks/`", ("benchmarks/**/*.py",)),
    Area("tests", "`tests/` (for scale; counted nowhere else)", ("tests/**/*.py",)),
)
BY_NAME = {a.name: a for a in AREAS}
_BLOCK = re.compile(r"<!-- figures: python tools/loc\.py([^>]*?)-->\n(.*?)<!-- /figures -->", re.S)
_ROW = re.compile(r"^\| `?([\w-]+)`? \|.*\| ([\d,]+) \| ([\d,]+) \|$", re.M)


def _files(area: Area, root: Path) -> set[Path]:
    found: set[Path] = set()
    for pattern in area.patterns:
        for path in root.glob(pattern):
            parts = path.relative_to(root).parts
            if path.is_file() and "__pycache__" not in parts and (area.name == "tests" or "tests" not in parts):
                found.add(path)
    return found


def count(area: Area, root: Path = ROOT) -> tuple[int, int]:
    """(files, lines) of one area."""
    files = _files(area, root)
    return len(files), sum(p.read_bytes().count(b"\n") for p in files)


def table(names: list[str], root: Path = ROOT) -> str:
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown area(s) {unknown}; the areas: {', '.join(BY_NAME)}")
    rows = ["| area | counts | files | lines |", "|---|---|---:|---:|"]
    for name in names:
        files, lines = count(BY_NAME[name], root)
        rows.append(f"| `{name}` | {BY_NAME[name].counts} | {files:,} | {lines:,} |")
    return "\n".join(rows) + "\n"


def blocks(text: str) -> list[tuple[list[str], dict[str, int]]]:
    """Each figures block of a document: the areas its comment names, and the lines its table quotes per area."""
    return [(args.split(), {m[0]: int(m[2].replace(",", "")) for m in _ROW.findall(body)})
            for args, body in _BLOCK.findall(text)]


def documents(root: Path = ROOT) -> list[Path]:
    return sorted({p for pattern in DOCUMENTS for p in root.glob(pattern)})


def drifts(root: Path = ROOT, tolerance: float = TOLERANCE) -> list[str]:
    """Every quoted figure more than `tolerance` off the tree (or naming no area), as a sentence."""
    found = []
    for doc in documents(root):
        for names, quoted in blocks(doc.read_text()):
            if sorted(quoted) != sorted(names):
                found.append(f"{doc.relative_to(root)}: the block for {names} has rows for {sorted(quoted)}")
            for name, lines in quoted.items():
                if name not in BY_NAME:
                    found.append(f"{doc.relative_to(root)}: no area named {name!r}")
                    continue
                actual = count(BY_NAME[name], root)[1]
                if abs(actual - lines) > tolerance * max(actual, 1):
                    found.append(f"{doc.relative_to(root)}: `{name}` is quoted as {lines:,} lines, "
                                 f"the tree has {actual:,}")
    return found


def write(root: Path = ROOT) -> list[Path]:
    """Regenerate every figures block in place; the documents that changed."""
    changed = []
    for doc in documents(root):
        text = doc.read_text()
        fresh = _BLOCK.sub(lambda m: f"<!-- figures: python tools/loc.py{m[1]}-->\n"
                                     f"{table(m[1].split(), root)}<!-- /figures -->", text)
        if fresh != text:
            doc.write_text(fresh)
            changed.append(doc)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("areas", nargs="*", help=f"areas to print (default: all): {', '.join(BY_NAME)}")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="refresh the figures blocks of README.md and docs/*.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if a quoted figure is more than 10 %% off")
    args = parser.parse_args(argv)
    if args.write:
        for doc in write():
            print(f"refreshed {doc.relative_to(ROOT)}")
        return 0
    if args.check:
        found = drifts()
        for line in found:
            print(line, file=sys.stderr)
        return 1 if found else 0
    sys.stdout.write(table(args.areas or list(BY_NAME)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
