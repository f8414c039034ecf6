"""A voice agent's turn: its request (`AgentRequest`: a turn's fields -> each part's own preparation, prefixed) and
the glue nodes that run per turn on the `function` engine (`AgentPrompt`: the transcript into the chat model's
template; `SpeechInput`: a piece of the reply into the TTS's request). The graph that wires them is
`voice_agent.py`'s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mstar_core.compose.voice_names import LLM_FIELDS, env
from mstar_core.errors import RequestError
from mstar_core.graph import Graph
from mstar_core.graph.compose import PartEnv, PartNames
from mstar_core.model import LoadedModel
from mstar_core.schema import RequestField, RequestSchema

# -- glue nodes (`function` engine; cheap, per request) ------------------------------------------------------


class AgentPrompt:
    """The turn's prompt for the chat model: the transcript (if the turn was spoken) after the conversation so far,
    through the chat model's own request preparation (its chat template); the last reply spliced back as the ids it
    was generated as, so the KV cache's pages of the previous turn match (a second turn prefills its new tokens)."""

    def __init__(self, asr_tokenizer: Any, llm: LoadedModel, llm_keys: Sequence[str]):
        self.asr_tokenizer, self.llm, self.llm_keys = asr_tokenizer, llm, tuple(llm_keys)
        self.tokenizer = llm.extras["tokenizer"]

    def __call__(self, messages: list, llm_fields: dict, previous: Any, first_token: int | None = None,
                 asr_tokens: list | None = None) -> dict[str, Any]:
        turn, transcript = list(messages), ""
        if first_token is not None:
            ids = [int(first_token), *(int(t) for t in asr_tokens or ())]
            transcript = self.asr_tokenizer.decode(ids, skip_special_tokens=True).strip()
            turn.append({"role": "user", "content": transcript})
        prepared = self.llm.prepare_inputs({"messages": turn, **llm_fields})
        if previous:
            prepared["input_ids"] = self.exact_history(list(prepared["input_ids"]), *previous)
        return {"transcript": transcript, "prompt_ids": list(prepared["input_ids"]),
                **{k: prepared.get(k) for k in self.llm_keys}}

    def exact_history(self, ids: list[int], prompt: Sequence[int], reply: Sequence[int]) -> list[int]:
        """`ids` with the previous reply as generated, when the chat template re-renders it as the same text."""
        prompt, reply = [int(t) for t in prompt], [int(t) for t in reply]
        text = self.tokenizer.decode(reply, skip_special_tokens=True)
        again = self.tokenizer.encode(text, add_special_tokens=False).ids
        at = len(prompt)
        if ids[:at] != prompt or ids[at:at + len(again)] != again:
            return ids  # the conversation changed under it: the prompt as rendered
        return prompt + reply + ids[at + len(again):]


class SpeechInput:
    """One chunk of the reply's tokens as the TTS's request (its own preparation); `speak_count` 0 for a chunk with
    nothing to say (the whitespace a reply ends with, or only a tool call), so the TTS's walk does not run for it.

    `unspoken`: (open, close) markers of spans the TTS skips (a tool call the chat model writes); `span` is the index
    of the span open at the chunk's start (-1: none), carried from chunk to chunk by the loop."""

    def __init__(self, decode: Any, tts: LoadedModel, tts_keys: Sequence[str]):
        self.decode, self.tts, self.tts_keys = decode, tts, tuple(tts_keys)

    def __call__(self, chunk: Any, tts_fields: dict, unspoken: Sequence[Sequence[str]] = (), span: int = -1
                 ) -> dict[str, Any]:
        text, span = spoken_part(self.decode(list(chunk.new_items)), unspoken, span)
        text = text.strip()
        if not text:
            return {"speak_count": 0, "text": "", "span": span, **dict.fromkeys(self.tts_keys)}
        prepared = self.tts.prepare_inputs({"input": text, **tts_fields})
        return {"speak_count": 1, "text": text, "span": span, **{k: prepared.get(k) for k in self.tts_keys}}


def spoken_part(text: str, unspoken: Sequence[Sequence[str]], span: int) -> tuple[str, int]:
    """`text` without what lies inside the `unspoken` spans, and the span still open at its end (-1: none)."""
    out, at = [], 0
    while at < len(text):
        if span >= 0:
            end = text.find(unspoken[span][1], at)
            if end < 0:
                return "".join(out), span
            at, span = end + len(unspoken[span][1]), -1
            continue
        opens = [(i, k) for k, (first, _) in enumerate(unspoken) if (i := text.find(first, at)) >= 0]
        if not opens:
            out.append(text[at:])
            break
        i, span = min(opens)
        out.append(text[at:i])
        at = i + len(unspoken[span][0])
    return "".join(out), span


def decoder(tokenizer: Any):
    return lambda ids: tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


# -- the request ----------------------------------------------------------------------------------------------


class AgentRequest:
    """`prepare(inputs)`: a turn's fields -> the env of the composed walks (each part's own preparation, prefixed)."""

    def __init__(self, parts: Mapping[str, LoadedModel], asr: PartNames, max_chunks: int,
                 speech_defaults: Mapping[str, Any] | None = None, transcript_max_tokens: int | None = None):
        self.parts, self.asr, self.max_chunks = parts, asr, max_chunks
        self.speech_defaults, self.transcript_max_tokens = dict(speech_defaults or {}), transcript_max_tokens
        asr_schema = parts["asr"].request_schema
        self.asr_temperature = asr_schema is not None and any(f.name == "temperature" for f in asr_schema.fields)
        rate = int(parts["asr"].extras.get("sample_rate", 16000))
        self.schema = RequestSchema(
            fields=(
                RequestField("audio", "tensor", f"the user's spoken turn: mono samples at {rate} Hz in [-1, 1]"),
                RequestField("language", "string", "the spoken language (ISO-639-1); detected when left out"),
                RequestField("transcript_max_tokens", "integer", "the most tokens of the transcript", minimum=1),
                RequestField("messages", "array", "the conversation before this turn (chat messages); a text turn "
                             "ends with the user's message", items="object", default=[]),
                RequestField("voice", "string", "the voice the reply is spoken in"),
                RequestField("speech_options", "object", "more fields of the TTS's own request for every piece it "
                             "speaks (checked by its schema), e.g. its frame bound", default={}),
                RequestField("speak", "boolean", "speak the reply (false: text only)", default=True),
                RequestField("max_tokens", "integer", "the most tokens of the reply", minimum=1),
                RequestField("temperature", "number", "the chat model's temperature", minimum=0),
                RequestField("top_p", "number", "the chat model's top-p", minimum=0, maximum=1, exclusive_minimum=True),
                RequestField("seed", "integer", "the chat model's seed"),
                RequestField("grammar", "array", "[kind, source]: the chat model's reply held to a grammar (a "
                             "tool call that must be written: the realtime route's tool_choice `required`)",
                             items="string"),
                RequestField("unspoken", "array", "(open, close) marker pairs of reply spans not to speak: the chat "
                             "model's tool calls", items="array", default=[], check=_marker_pairs),
                RequestField("previous_prompt_ids", "array", "the last turn's prompt ids (as emitted)", items="integer"),
                RequestField("previous_reply_ids", "array", "the last turn's reply ids (as emitted, no stop token)",
                             items="integer"),
            ),
            example={"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8},
            description="a voice agent's turn: speech (or a user message) in; transcript, reply text and speech out",
        )

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {env("speak"): bool(inputs["speak"]), env("max_chunks"): self.max_chunks}
        messages = list(inputs.get("messages") or [])
        if inputs.get("audio") is not None:
            asr_inputs = {"audio": inputs["audio"], **({"max_tokens": self.transcript_max_tokens}
                                                       if self.transcript_max_tokens else {})}
            if self.asr_temperature:  # a transcript is decoded greedily (Whisper's first pass; no fallback here)
                asr_inputs["temperature"] = 0.0
            for field, into in (("language", "language"), ("transcript_max_tokens", "max_tokens")):
                if inputs.get(field) is not None:
                    asr_inputs[into] = inputs[field]
            out.update(self.asr.prefixed(self.parts["asr"].prepare_inputs(asr_inputs)))
            out[env("has_audio")] = True
            asr_plan(self.parts["asr"].graph, out)  # a turn the ASR would read in windows is refused now
        elif not messages or not isinstance(messages[-1], Mapping) or messages[-1].get("role") != "user":
            raise RequestError("send 'audio' (the user's spoken turn), or end 'messages' with the user's message",
                               param="audio")
        llm_fields = {k: inputs[k] for k in LLM_FIELDS if inputs.get(k) is not None}
        # the chat model's own checks now, on the conversation as it stands: a bad field is this request's 4xx
        self.parts["llm"].prepare_inputs({"messages": messages or [{"role": "user", "content": "."}], **llm_fields})
        tts_fields = {**self.speech_defaults, **inputs["speech_options"],
                      **({"voice": inputs["voice"]} if inputs.get("voice") else {})}
        if "input" in tts_fields:
            raise RequestError("'speech_options' may not set 'input': the TTS speaks the reply", param="speech_options")
        if out[env("speak")]:
            self.parts["tts"].prepare_inputs({"input": ".", **tts_fields})
        prompt, reply = inputs.get("previous_prompt_ids"), inputs.get("previous_reply_ids")
        out.update({env("unspoken"): [tuple(p) for p in inputs["unspoken"]], env("span"): -1})
        out.update({env("messages"): messages, env("llm_fields"): llm_fields, env("tts_fields"): tts_fields,
                    env("previous"): (list(prompt), list(reply)) if prompt and reply is not None else None})
        return out


def _marker_pairs(value: list, name: str) -> list:
    if not all(isinstance(p, list | tuple) and len(p) == 2 and all(isinstance(m, str) and m for m in p) for p in value):
        raise RequestError(f"'{name}' must be a list of [open, close] pairs of non-empty strings", param=name)
    return value


def asr_plan(asr_graph: Graph, composed_env: Mapping[str, Any]) -> list[str]:
    """The ASR's walks for this turn, renamed, its `prefill, decode` as the composed `transcribe`."""
    walks = asr_graph.plan(PartEnv(composed_env, "asr"))
    if walks[-2:] != ["prefill", "decode"]:
        raise RequestError(f"this turn's audio takes the ASR's walks {walks}; a voice agent's turn must end in its "
                           "prefill and decode (at most one 30-second window): send a shorter turn", param="audio")
    return [f"asr.{w}" for w in walks[:-2]] + ["asr.transcribe"]
