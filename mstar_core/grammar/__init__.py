"""Constrained decoding: grammar specs on `SamplingParams`, the vocabulary they compile against, a compile cache.

A request's grammar travels as a `GrammarSpec` (kind and source text, so it crosses the wire as two strings);
the engine that samples compiles it against its model's `GrammarVocab` through `compiled()` (cached by the
spec's digest per vocabulary), and the HTTP edge compiles it first with `compile_bounded` (off the event loop)
so an engine in the same process finds it cached. Compiles run in a bounded pool of killable processes
(`pool.py`, `worker.py`, `zygote.py`) under the operator's limits (`limits.py`); schemas are checked before any
of that (`check.py`). The library is xgrammar (see BENCHMARKS.md, issue 30, for why not llguidance).
"""

from mstar_core.grammar.spec import GRAMMAR_KINDS, GrammarSpec, as_grammar
from mstar_core.grammar.vocab import GrammarVocab

__all__ = ["GRAMMAR_KINDS", "GrammarSpec", "GrammarVocab", "as_grammar"]
