"""How a realtime session drives a served model through its API adapter: chat models (text in, text out, and
speech when the adapter speaks in chat: `qwen3-omni`, `llama`), speech-only models (`orpheus`: the latest
user text is spoken), or a composed voice agent (`mstar_core.compose.voice_agent`: the turn's audio in, its
transcript, the chat model's reply and the TTS's speech out of one request; its chat model's adapter reads the
reply's tokens, its TTS's adapter the audio). No model code here: what a model takes and emits is the adapter's."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mstar_core.api.media import resample
from mstar_core.api.realtime.config import RATE, ResponseOptions, chosen_function
from mstar_core.api.realtime.conversation import Item, render
from mstar_core.api.realtime.protocol import EventError
from mstar_core.api.requests import tools as tl
from mstar_core.api.requests.adapters import ApiAdapter
from mstar_core.api.requests.formats import grammar_vocab, prepared_grammar
from mstar_core.api.requests.pipeline import chat_request, sampling_fields
from mstar_core.api.requests.tool_parser import CLOSE, OPEN
from mstar_core.grammar.spec import GrammarSpec


class ModelBridge:
    """One served model as the realtime session sees it."""

    def __init__(self, state: Any, model: str):
        self.state, self.model = state, model
        routes = state.routes_of(model)
        #: the composed model's output names by meaning (a voice agent), None for a model served on its own
        self.agent: dict[str, str] | None = None
        loaded = state.engine.models.get(model) if state.engine is not None else None
        extras = getattr(loaded, "extras", None) or {}
        if extras.get("composition") == "voice_agent":
            self._agent(extras)
            return
        if "chat" in routes:
            self.kind, self.adapter = "chat", state.adapter(model, "chat")
        elif "speech" in routes:
            self.kind, self.adapter = "speech", state.adapter(model, "speech")
        else:
            raise EventError(f"model '{model}' serves neither chat nor speech, so it cannot hold a realtime session",
                             param="model", code="model_not_supported")
        a: ApiAdapter = self.adapter
        self.speaks = self.kind == "speech" or getattr(a, "chat_audio_output", None) is not None
        self.audio_output = (a.audio_output if self.kind == "speech" else getattr(a, "chat_audio_output", None))
        self.voices: tuple[str, ...] = tuple(str(v).lower() for v in (getattr(a, "voices", ()) or ()))
        self.takes_audio = self.kind == "chat" and "audio" in (getattr(a, "chat_media", ()) or ())
        self.takes_tokens = bool(getattr(a, "takes_token_parts", False))
        media = set(getattr(a, "chat_media", ()) or ()) if self.kind == "chat" else set()
        self.takes_visual = {"image", "video"} <= media
        self.sample_rate = int(getattr(a, "sample_rate", RATE) or RATE)
        #: how tools, calls and their outputs are written for this model (chat's rule: `tools.tool_format`)
        self.tool_format = tl.tool_format(a)
        self.token_output = a.token_output
        self.audio_adapter = a

    def _agent(self, extras: Mapping[str, Any]) -> None:
        """A voice agent: its chat model's chat adapter reads the reply's tokens (and writes tools as that model
        does), its TTS's speech adapter turns the audio into samples."""
        parts = extras["parts"]
        self.kind, self.agent = "agent", dict(extras["outputs"])
        self.adapter = self.state.adapter(parts["llm"], "chat")
        self.audio_adapter = self.state.adapter(parts["tts"], "speech")
        self.speaks, self.takes_audio, self.takes_tokens, self.takes_visual = True, True, False, False
        self.audio_output, self.token_output = self.agent["audio"], self.agent["token"]
        self.voices = tuple(str(v).lower() for v in (extras.get("voices") or ()))
        self.sample_rate = int(extras.get("sample_rate") or RATE)
        self.asr_rate = int(extras.get("asr_sample_rate") or 16000)
        self.tool_format = tl.tool_format(self.adapter)

    @property
    def default_modalities(self) -> tuple[str, ...]:
        return ("audio",) if self.speaks else ("text",)

    async def inputs(self, items: Sequence[Item], options: ResponseOptions,
                     previous: tuple[list[int], Item] | None = None) -> dict[str, Any]:
        """The model's raw inputs for a response over `items` with `options`; `previous` (the last response's
        prompt ids and reply item) lets a text model's next prompt carry that reply's exact ids. A chat model's
        turn goes through the text routes' pipeline (`requests.pipeline.chat_request`)."""
        speak = options.output_modalities == ("audio",)
        sampling = sampling_fields({"max_tokens": options.max_output_tokens, "temperature": options.temperature})
        if self.kind == "agent":  # (off the loop: resampling the turn's audio takes a CPU's while)
            grammar = await self._tool_grammar(options)
            return await asyncio.to_thread(self._agent_inputs, items, options, previous, speak,
                                           {**sampling, **({"grammar": grammar} if grammar else {})})
        if self.kind == "speech":
            text = next((i.text for i in reversed(items) if i.type == "message" and i.role == "user" and i.text), "")
            if not text.strip():
                raise EventError(f"model '{self.model}' speaks the latest user text item; add one "
                                 "(conversation.item.create with input_text)", param="response", code="no_user_text")
            body = {"input": text, "voice": options.voice or (self.voices[0] if self.voices else None), "speed": 1.0,
                    "response_format": "pcm", "stream_format": "audio", "model": self.model, **sampling}
            return self._call(self.adapter.speech_inputs, body)
        tools = self.tools(options)
        # off the loop: a long audio item's samples are converted here (a 119 s append held the loop ~40 ms)
        turns, plain = await asyncio.to_thread(render, items, options.instructions, tools, self.tool_format,
                                               takes_audio=self.takes_audio, takes_tokens=self.takes_tokens,
                                               takes_visual=self.takes_visual)
        if not turns or turns[-1].role == "assistant":
            raise EventError("the conversation has nothing for the model to answer; add a user item first",
                             param="response", code="nothing_to_answer")
        body: dict[str, Any] = {"model": self.model, "messages": plain, **sampling}
        if speak:
            body["modalities"] = ["text", "audio"]
            body["audio"] = {"voice": options.voice or self.voices[0], "format": "pcm16"}
        # held to the tools' grammar where the model decodes under one (a model that cannot still gets the tools in
        # its prompt, as it did before: the chat route refuses tools there, a session already holding them goes on)
        spec = self._tool_grammar_spec(options) if grammar_vocab(self.adapter) is not None else None
        inputs = await chat_request(self.state, self.adapter, self.model, body, turns=turns, call=self._call,
                                    response_format=spec, format_param="tool_choice")
        if previous is not None and not self.takes_tokens and options.input is None:
            inputs = self._exact_history(inputs, previous)
        return inputs

    def _agent_inputs(self, items: Sequence[Item], options: ResponseOptions, previous: tuple[list[int], Item] | None,
                      speak: bool, sampling: Mapping[str, Any]) -> dict[str, Any]:
        """A voice agent's turn: the last user item's audio (when it has no transcript yet) is the turn, the items
        before it the conversation in text (a spoken item as its transcript)."""
        import attrs
        import torch

        items = list(items)
        last = items[-1] if items else None
        audio = None
        if last is not None and last.type == "message" and last.role == "user" and last.audio is not None \
                and not last.text:
            audio, items = last.audio, items[:-1]
        texts = [attrs.evolve(i, audio=None) if i.audio is not None else i for i in items]
        _, plain = render(texts, options.instructions, self.tools(options), self.tool_format, takes_audio=False,
                          takes_tokens=False)
        if audio is None and (not plain or plain[-1]["role"] != "user"):
            raise EventError("the conversation has nothing for the model to answer; add a user item first",
                             param="response", code="nothing_to_answer")
        body: dict[str, Any] = {"messages": plain, "speak": speak, **sampling}
        if self.tools(options) and self.tool_format == "hermes":  # a tool call is an item, not something to say
            body["unspoken"] = [[OPEN, CLOSE]]
        if audio is not None:
            samples = audio.astype(np.float32) / 32768.0
            body["audio"] = torch.from_numpy(np.ascontiguousarray(resample(samples, RATE, self.asr_rate)))
        if speak and (options.voice or self.voices):
            body["voice"] = options.voice or self.voices[0]
        if previous is not None and previous[1].ids and options.input is None:
            body["previous_prompt_ids"], body["previous_reply_ids"] = list(previous[0]), list(previous[1].ids)
        return {k: v for k, v in body.items() if v is not None}

    async def _tool_grammar(self, options: ResponseOptions) -> list[str] | None:
        """A voice agent's chat model held to the tools' grammar (compiled for it)."""
        return await prepared_grammar(self.adapter, self.model, self._tool_grammar_spec(options), "tool_choice")

    def _tool_grammar_spec(self, options: ResponseOptions) -> GrammarSpec | None:
        """The tools' grammar, as chat's: `required` must write a call, `auto` may, a named function must call it,
        and a call the model opens is well formed (one call a response: the client answers it, then asks again)."""
        tools = self.tools(options)
        if not tools:
            return None
        name = chosen_function(options.tool_choice)  # (one of the tools: checked when it was set)
        mode = "function" if name is not None else options.tool_choice
        return tl.tool_grammar(tools, self.tool_format, mode, name, parallel=False)

    @staticmethod
    def tools(options: ResponseOptions) -> list[tl.Tool]:
        """The response's tools as chat's checked tools (none when `tool_choice` is none)."""
        if options.tool_choice == "none":
            return []
        return [tl.Tool(t["name"], t.get("description") or "", dict(t.get("parameters") or {})) for t in options.tools]

    def tool_calls(self, options: ResponseOptions) -> tl.ToolCalls | None:
        """The parser of the reply's calls, in the model's tool format (chat's parser), when tools are offered."""
        return tl.ToolCalls(self.tool_format) if self.tools(options) else None

    def _exact_history(self, inputs: dict[str, Any], previous: tuple[list[int], Item]) -> dict[str, Any]:
        """A text model's prompt with the last reply as the ids it generated, not their re-tokenized text, so the
        KV cache's pages match (for models whose `prepare` takes `input_ids`; any mismatch leaves the prompt)."""
        prompt, item = previous
        loaded = self.state.engine.models.get(self.model)
        tokenizer = getattr(self.adapter, "tokenizer", None)
        schema = getattr(loaded, "request_schema", None)
        if (item.ids is None or not item.ids or tokenizer is None or "messages" not in inputs or schema is None
                or not any(f.name == "input_ids" for f in schema.fields) or not callable(getattr(loaded, "prepare",
                                                                                               None))):
            return inputs
        try:
            ids = [int(t) for t in loaded.prepare(dict(inputs))["input_ids"]]
        except Exception:  # the request's own errors come back from the engine's prepare, as they would anyway
            return inputs
        reply = tokenizer.encode(item.text, add_special_tokens=False).ids
        at = len(prompt)
        if ids[:at] != prompt or ids[at:at + len(reply)] != reply:
            return inputs
        exact = {k: v for k, v in inputs.items() if k != "messages"}
        exact["input_ids"] = prompt + list(item.ids) + ids[at + len(reply):]
        return exact

    def _call(self, fn: Any, *args: Any) -> dict[str, Any]:
        from mstar_core.errors import RequestError

        try:
            return fn(*args)
        except RequestError as exc:
            raise EventError(str(exc), param=getattr(exc, "param", None), code="invalid_request") from None
        except (ValueError, TypeError, KeyError) as exc:
            raise EventError(f"model '{self.model}' rejected the request: {type(exc).__name__}: {exc}",
                             code="invalid_request") from None

    def pcm(self, value: Any) -> np.ndarray:
        """One emitted audio value as int16 samples at 24 kHz."""
        samples = self.audio_adapter.audio_chunk(value)
        if self.sample_rate != RATE and samples.size:
            samples = np.clip(resample(samples.astype(np.float32) / 32768.0, self.sample_rate, RATE) * 32767.0,
                              -32768, 32767).astype(np.int16)
        return samples

    def prompt_tokens(self, prepared: Mapping[str, Any]) -> int:
        if self.kind == "agent":
            return 0  # its prompt is written mid-request (after the transcript): counted when it is emitted
        return int(self.adapter.prompt_tokens({}, prepared))

    def prompt_ids(self, prepared: Mapping[str, Any]) -> list[int] | None:
        for key in ("input_ids", "prompt_ids"):
            ids = prepared.get(key)
            if ids is not None:
                return [int(t) for t in ids]
        return None
