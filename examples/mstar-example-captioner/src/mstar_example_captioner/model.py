"""`ModelSpec("example-captioner")`: load a checkpoint directory or the `tiny` preset into a `LoadedModel`."""

from __future__ import annotations

from mstar_core.model import LoadedModel, LoadOptions, ModelSpec
from mstar_example_captioner.checkpoint import ensure_tiny, load_captioner
from mstar_example_captioner.graph import build_graph
from mstar_example_captioner.prepare import EXAMPLE, CaptionRequestPreparer
from mstar_example_captioner.tokenizer import CharTokenizer

NAME = "example-captioner"
PRESETS = ("tiny",)


def load(options: LoadOptions) -> LoadedModel:
    preset = options.preset_or_checkpoint(NAME, PRESETS)
    directory = ensure_tiny() if preset else options.checkpoint
    # device="meta" (a serving process whose nodes all run in workers) builds shapes and reads no weights
    model = load_captioner(directory, device=options.device, dtype=options.torch_dtype(NAME))
    tokenizer = CharTokenizer()
    return LoadedModel(
        name=NAME,
        graph=build_graph(model, tokenizer, NAME),
        random_weights=preset is not None,
        prepare=(prepare := CaptionRequestPreparer(model.config, tokenizer)),
        request_schema=prepare.schema,
        engine_settings={"lm": {"num_pages": 256, "page_size": 16}},
        extras={"model": model, "tokenizer": tokenizer, "config": model.config, "checkpoint": str(directory)},
    )


SPEC = ModelSpec(
    name=NAME,
    load=load,
    presets=PRESETS,
    example=EXAMPLE,
    description="worked example: image encoder (stateless) -> spliced prompt -> paged-KV caption decoder",
)
