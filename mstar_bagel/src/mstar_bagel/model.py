"""`ModelSpec` `bagel`: a BAGEL checkpoint directory or the `tiny` preset -> `LoadedModel`."""

from __future__ import annotations

import json
from pathlib import Path

from mstar_bagel.checkpoint import ensure_tiny, load_bagel
from mstar_bagel.graph import build_graph
from mstar_bagel.parallel import load_bagel_tensor_parallel
from mstar_bagel.prepare import Preparer
from mstar_bagel.tokenizer import open_tokenizer, special_ids
from mstar_core.grammar import GrammarVocab
from mstar_core.model import LoadedModel, LoadOptions, ModelSpec

PRESETS = ("tiny",)
EXAMPLE = {"task": "t2i", "prompt": "a red fox in the snow", "num_steps": 3}


#: Requests whose flow loops run at once (`llm_gen`'s runtime setting `max_active_requests`; the rest wait, oldest
#: first). One request's step (three branches of a whole latent image: 3 x 4098 tokens at 1024x1024) already keeps
#: the device busy, so batching more requests' flows adds little throughput while every one of them finishes as
#: late as the last: one at a time, the first finishes after one flow, the median after 2.5 instead of about 4.
#: A deployment of small images on a large GPU can raise it per node setting (`{"llm_gen": {...}}`).
FLOW_REQUESTS = 1


def engine_settings(cfg) -> dict:
    """Room for every request's KV, a token budget for 4 x 3 CFG branches in one forward, one flow at a time.

    A latent block is bidirectional, so it is never split across steps: under a smaller budget the
    branches would run one per forward. The budget still counts for `n` images of one request (their
    branches share a forward) and where `max_active_requests` is raised.
    """
    block = cfg.max_latent_size**2 + 2
    pages = max(512, 8 * 2 * (2 * block + 1024) // 16)
    return {"llm": {"num_pages": pages, "page_size": 16, "max_num_batched_tokens": max(2048, block)},
            "llm_gen": {"num_pages": pages, "page_size": 16, "max_num_batched_tokens": max(512, 4 * 3 * block),
                        "max_active_requests": FLOW_REQUESTS}}


def load(options: LoadOptions) -> LoadedModel:
    preset = options.preset_or_checkpoint("bagel", PRESETS)
    directory = Path(ensure_tiny() if preset else options.checkpoint)
    # presets are tiny: float32; a real checkpoint (14B parameters, stored bf16) loads as bf16 unless told otherwise
    dtype = options.torch_dtype("bagel", "float32" if preset else "bfloat16")
    group = options.tensor_parallel  # (the rank group, if any)
    if group is not None and group.world_size > 1 and options.device != "meta":
        bagel, vae = load_bagel_tensor_parallel(directory, group, device=options.device, dtype=dtype)
    else:
        bagel, vae = load_bagel(directory, device=options.device, dtype=dtype)
    tokenizer = open_tokenizer(directory)
    top = json.loads((directory / "config.json").read_text())
    prepare = Preparer(bagel.config, tokenizer, special_ids(tokenizer), top.get("think_system_prompt"))
    # what the `llm` node's sampling grammars compile against (structured outputs, tool calls): a grammar ends on
    # <|im_end|>, and the image delimiters are special tokens, so a constrained reply never opens an image
    grammar_vocab = GrammarVocab.from_tokenizer(tokenizer, bagel.config.llm.vocab_size, [prepare.ids.eos])
    return LoadedModel(
        name="bagel",
        graph=build_graph(bagel, vae, tokenizer, prepare.ids.eos, prepare.ids.boi, grammar_vocab=grammar_vocab),
        random_weights=preset is not None,
        prepare=prepare,
        request_schema=prepare.schema,
        engine_settings=engine_settings(bagel.config),
        extras={"bagel": bagel, "vae": vae, "config": bagel.config, "tokenizer": tokenizer, "checkpoint": str(directory),
                "special_ids": prepare.ids, "grammar_vocab": grammar_vocab},
    )


SPEC = ModelSpec(name="bagel", load=load, presets=PRESETS, example=EXAMPLE,
                 description="BAGEL: MoT LLM + SigLIP NaViT + FLUX VAE; understanding, text-to-image, image editing "
                             "(three CFG cache labels, read-only flow steps)")
