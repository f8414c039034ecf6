"""`mstar run`: one request offline, through the same adapters as the server, written to a file."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from mstar_core.api.media.tensors import decode_inputs, encode_value
from mstar_core.api.requests.adapters import validate_adapter, with_defaults
from mstar_core.api.requests.chat_adapter import TokenizerChatAdapter
from mstar_core.errors import MStarError
from mstar_core.model import LoadOptions

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


class ExamplesHelp(argparse.Action):
    """`-h/--help` that also lists each installed model's example request (plugins are discovered only then)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.epilog = examples_epilog(getattr(namespace, "plugin", None) or [])
        parser.print_help()
        parser.exit()


def examples_epilog(extra_plugins: list[str]) -> str:
    """`mstar run MODEL --inputs '...'` for every installed model that gives an example request."""
    from mstar_core.plugins.manager import discover

    try:
        registry = discover(extra_modules=extra_plugins)
    except Exception as exc:  # help must print whatever a plugin does
        return f"(could not list models: {type(exc).__name__}: {exc})"
    lines = ["examples (each installed model's own example request, run on its tiny preset):"]
    for name in sorted(registry.models):
        spec = registry.models.get(name)
        if spec.example is None:
            lines.append(f"  mstar run {name} --inputs '{{...}}'    # no example declared; `mstar serve {name}` "
                         "documents its inputs at /docs")
        else:
            lines.append(f"  mstar run {name} --inputs '{_shell_json(spec.example)}'")
    return "\n".join(lines)


def _shell_json(value: Any) -> str:
    return json.dumps(value).replace("'", "'\\''")


def add_arguments(p: argparse.ArgumentParser) -> None:
    if p.add_help is False:
        p.add_argument("-h", "--help", action=ExamplesHelp, help="show this help and every model's example request")
    p.add_argument("model")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", help="speak this text (speech models); writes audio")
    what.add_argument("--prompt", help="chat: one user message; writes the reply (with --out *.png: generates an image)")
    what.add_argument("--inputs", help="raw walk inputs as JSON (native); writes the final outputs as JSON")
    p.add_argument("--voice", help="voice for --text (default: the model's first)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--size", default=None, help="image size WxH for --prompt with --out *.png (default: the model's)")
    p.add_argument("--seed", type=int, default=None, help="seed for --prompt with --out *.png")
    p.add_argument("--out", "-o", default=None, help="output file (default speech.wav / reply.txt / outputs.json)")
    p.add_argument("--checkpoint")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE")
    p.add_argument("--no-progress", action="store_true")


def _adapter(registry: Any, name: str, loaded: Any, route: str) -> Any:
    for raw in registry.api_adapters:
        if getattr(raw, "model", None) == name and route in raw.routes:
            validate_adapter(raw)
            adapter = with_defaults(raw)
            adapter.bind(loaded)
            return adapter
    if route == "chat" and {"tokenizer", "chat_template"} <= set(loaded.extras or {}):
        return TokenizerChatAdapter(name, loaded)
    raise MStarError(f"model '{name}' has no {route} adapter; use --inputs to run its walks directly")


async def _run(args: argparse.Namespace) -> str:
    from tqdm import tqdm

    from mstar_core.plugins.manager import discover
    from mstar_core.runtime import AsyncEngine

    registry = discover(extra_modules=args.plugin)
    options = LoadOptions(checkpoint=args.checkpoint, device=args.device) if args.checkpoint else \
        LoadOptions(preset=args.preset, device=args.device)
    async with AsyncEngine(registry, device=args.device) as engine:
        loaded = await engine.load_model(args.model, options, alias=args.model)
        if loaded.random_weights:
            print(f"note: '{args.model}' runs with random weights (preset '{args.preset}'): output is noise",
                  file=sys.stderr)
        bar = tqdm(disable=args.no_progress, file=sys.stderr)
        if args.text is not None:
            adapter = _adapter(registry, args.model, loaded, "speech")
            voice = args.voice or (adapter.voices[0] if adapter.voices else "default")
            body = {"model": args.model, "input": args.text, "voice": voice, "response_format": "wav", "speed": 1.0}
            handle = engine.submit(args.model, adapter.speech_inputs(body))
            bar.set_description("audio seconds")
            chunks = []
            async for out in handle:
                if out.name == adapter.audio_output:
                    pcm = adapter.audio_chunk(out.value)
                    chunks.append(pcm)
                    bar.update(round(pcm.size / adapter.sample_rate, 3))
            bar.close()
            import soundfile

            out_path = args.out or "speech.wav"
            audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)
            soundfile.write(out_path, audio, int(adapter.sample_rate), subtype="PCM_16")
            return f"wrote {out_path}: {audio.size / adapter.sample_rate:.2f} s at {adapter.sample_rate} Hz"
        if args.prompt is not None and Path(args.out or "").suffix.lower() in IMAGE_SUFFIXES:
            adapter = _adapter(registry, args.model, loaded, "images")
            body = {"model": args.model, "prompt": args.prompt, "n": 1, "size": args.size, "seed": args.seed,
                    "response_format": "b64_json", "index": 0}
            handle = engine.submit(args.model, adapter.image_inputs(body, edit=False))
            bar.set_description("steps")
            async for _out in handle:  # a model emits per denoising step (BAGEL: each step's sigma)
                bar.update(1)
            env = await handle.result()
            bar.close()
            images = adapter.images_from_env(env)
            if not images:
                raise MStarError(f"model '{args.model}' produced no image")
            Path(args.out).write_bytes(images[0])
            return f"wrote {args.out}"
        if args.prompt is not None:
            adapter = _adapter(registry, args.model, loaded, "chat")
            body = {"model": args.model, "messages": [{"role": "user", "content": args.prompt}],
                    "max_tokens": args.max_tokens}
            handle = engine.submit(args.model, adapter.chat_inputs(body))
            bar.set_description("tokens")
            ids = []
            async for out in handle:
                if out.name == adapter.token_output:
                    if adapter.is_stop_token(int(out.value)):
                        break
                    ids.append(int(out.value))
                    bar.update(1)
            handle.cancel()
            bar.close()
            text = adapter.detokenize(ids)
            out_path = args.out or "reply.txt"
            Path(out_path).write_text(text)
            return f"wrote {out_path}: {len(ids)} tokens"
        inputs = decode_inputs(json.loads(args.inputs))
        handle = engine.submit(args.model, inputs)
        async for _out in handle:
            bar.update(1)
        env = await handle.result()
        bar.close()
        names = [n for n in loaded.graph.declared_outputs(handle.walks) if n in env]
        out_path = args.out or "outputs.json"
        Path(out_path).write_text(json.dumps({n: encode_value(env[n]) for n in names}))
        return f"wrote {out_path}: outputs {', '.join(names)}"


def run(args: argparse.Namespace) -> int:
    try:
        print(asyncio.run(_run(args)))
    except (MStarError, json.JSONDecodeError) as exc:
        print(f"mstar run: {exc}", file=sys.stderr)
        return 2
    return 0
