"""Toy models for the server tests: speech, chat and images over a paged toy engine, with API adapters.

Loaded into a server with `mstar serve ... --plugin mstar_toy_models` (this directory on PYTHONPATH).
Outputs are exact and cheap, so the tests can check lengths, text and page accounting precisely.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from mstar_core.api.requests.adapters import ApiAdapter
from mstar_core.errors import RequestError
from mstar_core.graph import DynamicLoop, Graph, GraphNode, NodeCall, Walk
from mstar_core.model import LoadedModel, ModelSpec
from mstar_core.plugins import hookimpl
from mstar_core.runtime.function_engine import FunctionEngine

SAMPLES_PER_CHUNK = 480
SAMPLE_RATE = 16000
VOICES = {"alpha": 220.0, "beta": 330.0}
PAGES_PER_REQUEST = 2


class ToyPagedEngine(FunctionEngine):
    """The function engine plus a page pool: a request holds pages from its first call until released."""

    kind = "toy_paged"

    def __init__(self, node, module, context):
        super().__init__(node, module, context)
        self.num_pages = int(context.settings.get("num_pages", 4096))
        self.owners: dict[str, int] = {}
        self.delay = float(os.environ.get("MSTAR_TOY_STEP_DELAY", "0"))

    def add(self, invocation):
        if invocation.request_id not in self.owners:
            if self.num_pages - sum(self.owners.values()) < PAGES_PER_REQUEST:
                raise RuntimeError("toy page pool exhausted")
            self.owners[invocation.request_id] = PAGES_PER_REQUEST
        super().add(invocation)

    def step(self):
        if self.delay:
            import time

            time.sleep(self.delay)
        return super().step()

    def release(self, request_id):
        super().release(request_id)
        self.owners.pop(request_id, None)

    def active_requests(self):
        return super().active_requests() | set(self.owners)

    def stats(self):
        used = sum(self.owners.values())
        return {"kv_pages_used": used, "kv_pages_free": self.num_pages - used}


def tokenizer() -> Tokenizer:
    """A byte-level tokenizer with no merges: every byte is a token, plus <|eos|>."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<|eos|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>"])
    return tok


# --- toy-tts: one chunk of a sine per character -------------------------------------------------------------

#: Text that starts with this makes toy-tts fail after its first chunk (a stream that breaks mid-way).
FAIL_AFTER_FIRST_CHUNK = "fail:"


def _speak(loop_index, n_chunks, freq, fail_at):
    if loop_index == fail_at:
        raise RuntimeError(f"toy-tts was told to fail at chunk {fail_at}")
    t = (np.arange(SAMPLES_PER_CHUNK) + loop_index * SAMPLES_PER_CHUNK) / SAMPLE_RATE
    audio = torch.from_numpy((0.5 * np.sin(2 * math.pi * freq * t)).astype(np.float32))
    return {"audio": audio, "done": loop_index + 1 >= n_chunks}


def _tts_prepare(inputs):
    text, voice = inputs.get("text"), inputs.get("voice")
    if not isinstance(text, str) or not text:
        raise RequestError("'text' must be a non-empty string")
    if voice not in VOICES:
        raise RequestError(f"voice must be one of {sorted(VOICES)}")
    fail_at = 1 if text.startswith(FAIL_AFTER_FIRST_CHUNK) else -1
    return {"n_chunks": len(text), "freq": VOICES[voice], "input_ids": list(text.encode()), "fail_at": fail_at}


def load_tts(options):
    graph = Graph.build(
        "toy-tts",
        [GraphNode("gen", inputs=("loop_index", "n_chunks", "freq", "fail_at"), outputs=("audio", "done"),
                   engine="toy_paged", module=lambda: _speak)],
        [Walk(name="speak", body=DynamicLoop(body=NodeCall("gen"), until=lambda env: env["done"], max_iters="n_chunks"),
              inputs=("n_chunks", "freq", "fail_at"), emit=("audio",))],
    )
    return LoadedModel(name="toy-tts", graph=graph, random_weights=True, prepare=_tts_prepare,
                       extras={"sample_rate": SAMPLE_RATE})


class ToyTtsAdapter(ApiAdapter):
    model = "toy-tts"
    routes = {"speech"}
    voices = sorted(VOICES)
    sample_rate = SAMPLE_RATE

    def speech_inputs(self, body):
        return {"text": body["input"], "voice": body["voice"]}


# --- toy-chat: echoes the last user message, then <|eos|> ---------------------------------------------------


def _chat_prepare(inputs, tok=None):
    tok = tok or _TOK
    messages = inputs.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    prompt = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
    last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    eos = tok.token_to_id("<|eos|>")
    max_tokens = int(inputs.get("max_tokens") or 256)
    return {"input_ids": tok.encode(prompt).ids, "reply": tok.encode(last_user).ids + [eos],
            "max_tokens": max_tokens, "eos": eos}


def _lm(loop_index, reply, max_tokens, eos):
    token = reply[loop_index]
    reason = "stop" if token == eos else ("length" if loop_index + 1 >= max_tokens else None)
    return {"next_token": token, "finish_reason": reason}


_TOK = tokenizer()


def load_chat(options):
    graph = Graph.build(
        "toy-chat",
        [GraphNode("lm", inputs=("loop_index", "reply", "max_tokens", "eos"), outputs=("next_token", "finish_reason"),
                   engine="toy_paged", module=lambda: _lm)],
        [Walk(name="generate",
              body=DynamicLoop(body=NodeCall("lm"), until=lambda env: env["finish_reason"] is not None, max_iters="max_tokens"),
              inputs=("reply", "max_tokens", "eos"), outputs=("finish_reason",), emit=("next_token",))],
    )
    return LoadedModel(name="toy-chat", graph=graph, random_weights=True, prepare=_chat_prepare,
                       extras={"tokenizer": _TOK, "chat_template": "<{role}>{content}\n", "eos_token_ids": [_TOK.token_to_id("<|eos|>")]})


# --- toy-image: a flat colour picked by the seed -------------------------------------------------------------


def _paint(width, height, seed):
    g = torch.Generator().manual_seed(int(seed))
    colour = torch.randint(0, 256, (3,), generator=g, dtype=torch.uint8)
    return {"image": colour.view(1, 1, 3).expand(height, width, 3).contiguous()}


def load_image(options):
    graph = Graph.build(
        "toy-image",
        [GraphNode("paint", inputs=("width", "height", "seed"), outputs=("image",), engine="function",
                   module=lambda: _paint)],
        [Walk(name="paint", body="paint", inputs=("width", "height", "seed"), outputs=("image",))],
    )
    return LoadedModel(name="toy-image", graph=graph, random_weights=True)


class ToyImageAdapter(ApiAdapter):
    model = "toy-image"
    routes = {"images"}

    def image_inputs(self, body, *, edit):
        width, height = (int(v) for v in body["size"].split("x"))
        if width > 64 or height > 64:
            raise RequestError("toy-image paints at most 64x64; pass a smaller 'size'")
        return {"width": width, "height": height, "seed": body.get("seed") or 0}


@hookimpl
def mstar_register_engines(register):
    register("toy_paged", ToyPagedEngine)


@hookimpl
def mstar_register_models(register):
    register(ModelSpec(name="toy-tts", load=load_tts, description="sine per character (server tests)"))
    register(ModelSpec(name="toy-chat", load=load_chat, description="echoes the last user message (server tests)"))
    register(ModelSpec(name="toy-image", load=load_image, description="a flat colour (server tests)"))


@hookimpl
def mstar_register_api_adapters(register):
    register(ToyTtsAdapter())
    register(ToyImageAdapter())
