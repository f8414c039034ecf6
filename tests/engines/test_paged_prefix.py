"""Prefix caching with embeddings: page keys are digests of ids and content, so only equal content shares pages."""

from __future__ import annotations

import pathlib
import re

import torch

from mstar_core.graph import GraphNode
from tests.engines.paged_tiny import HIDDEN, TinyNode, dense, engine_for, run

NODE = GraphNode("lm", inputs=("input_ids",), optional_inputs=("input_embeds", "embeds_at"), outputs=("hidden",),
                 engine="kvcache")
IDS = [1, 2, 0, 0, 0, 0, 0, 3, 4, 5, 6, 7, 8, 9]  # five image placeholders (id 0) between text
AT = torch.tensor([i in range(2, 7) for i in range(len(IDS))])


def _spliced(module, image):
    rows = module.embed(torch.tensor(IDS)).detach().clone()
    rows[AT] = image
    return rows


def test_a_prefix_hit_with_embeddings_gives_identical_outputs():
    module = TinyNode()
    engine = engine_for(module, NODE)
    image = torch.randn(5, HIDDEN)
    first = run(engine, "a", {"input_ids": IDS, "input_embeds": image, "embeds_at": AT})
    engine.release("a")
    hits = engine.pool.hits
    again = run(engine, "b", {"input_ids": IDS, "input_embeds": image.clone(), "embeds_at": AT}, output_rows="last")
    assert engine.pool.hits - hits == (len(IDS) - 1) // engine.pool.page_size  # every full page but the last token's
    torch.testing.assert_close(again["hidden"], first["hidden"][-1:], atol=1e-6, rtol=0)  # (cached keys, shorter SDPA)
    ref = dense(module, input_embeds=_spliced(module, image))
    torch.testing.assert_close(first["hidden"], ref, atol=1e-5, rtol=0)


def test_different_embeddings_behind_identical_ids_never_hit():
    module = TinyNode()
    engine = engine_for(module, NODE)
    one, two = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    run(engine, "a", {"input_ids": IDS, "input_embeds": one, "embeds_at": AT})
    engine.release("a")
    hits = engine.pool.hits
    got = run(engine, "b", {"input_ids": IDS, "input_embeds": two, "embeds_at": AT})
    assert engine.pool.hits == hits  # the first page (ids 1, 2 and two image rows) differs: nothing after it is shared
    torch.testing.assert_close(got["hidden"], dense(module, input_embeds=_spliced(module, two)), atol=1e-5, rtol=0)
    # plain ids still share the pages before any embedding
    run(engine, "c", {"input_ids": [9, 9, 9, 9, 9, 9]})
    engine.release("c")
    hits = engine.pool.hits
    run(engine, "d", {"input_ids": [9, 9, 9, 9, 9, 9, 1]})
    assert engine.pool.hits == hits + 1


def test_explicit_positions_are_part_of_the_key():
    module = TinyNode()
    engine = engine_for(module, GraphNode("lm", inputs=("input_ids",), optional_inputs=("positions",),
                                          outputs=("hidden",), engine="kvcache"))
    ids = list(range(1, 10))
    run(engine, "a", {"input_ids": ids})
    engine.release("a")
    hits = engine.pool.hits
    got = run(engine, "b", {"input_ids": ids, "positions": torch.arange(9) * 2})
    assert engine.pool.hits == hits
    torch.testing.assert_close(got["hidden"], dense(module, ids, positions=torch.arange(9) * 2), atol=1e-5, rtol=0)


def test_no_python_hash_in_the_engine():
    src = pathlib.Path(__file__).parents[2] / "plugins" / "mstar-kvcache" / "src" / "mstar_kvcache"
    for path in src.glob("*.py"):
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        assert not re.search(r"(?<![\w.])hash\(", code), path.name


def test_a_continued_conversation_computes_only_its_new_tokens():
    """A request that continues a finished one (its prompt and the tokens it fed back, then new ones) reuses the
    finished one's last, partly written page too: it computes exactly its new tokens, with the same outputs."""
    module = TinyNode()
    engine = engine_for(module, NODE)  # (page_size 4)
    first = [5, 6, 7, 8, 9, 10, 11]  # one full page and 3 tokens of the next
    run(engine, "a", {"input_ids": first})
    engine.release("a")
    cont = first + [12, 13, 14]
    before, hits = engine.tokens_forwarded, engine.pool.partial_hits
    got = run(engine, "b", {"input_ids": cont})
    assert engine.tokens_forwarded - before == 3 and engine.pool.partial_hits == hits + 1
    torch.testing.assert_close(got["hidden"], dense(module, cont)[len(first):], atol=1e-5, rtol=0)
    engine.release("b")
    # the same start again, then a different continuation of its partial page: that one reuses the page, writes its
    # own tokens in place past the cached three, and the page (full now) is keyed as a full page
    run(engine, "a2", {"input_ids": first})
    engine.release("a2")
    other = first + [40]
    before = engine.tokens_forwarded
    got = run(engine, "c", {"input_ids": other + [41]})
    assert engine.tokens_forwarded - before == 2
    torch.testing.assert_close(got["hidden"], dense(module, other + [41])[len(first):], atol=1e-5, rtol=0)
    engine.release("c")
    hits = engine.pool.hits
    run(engine, "d", {"input_ids": other + [2, 3]})
    assert engine.pool.hits == hits + 2  # both of c's full pages
    engine.release("d")
    hits = engine.pool.hits
    run(engine, "e", {"input_ids": cont + [1]})
    assert engine.pool.hits == hits + 2  # and b's, untouched by c
