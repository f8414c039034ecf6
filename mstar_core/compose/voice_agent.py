"""The `voice_agent` composition: an ASR, a chat model and a TTS as one Walk Graph.

```
asr.encode, asr.detect, ...   the ASR's own walks up to its prompt (renamed: `asr/<node>`, env `asr:<name>`)
asr.transcribe                its prefill then its decode loop, the tokens collected (`agent:asr_tokens`)
respond                       agent/prompt: transcript -> the chat model's chat template (the conversation so far
                              plus this turn) -> llm prefill -> llm decode loop
                              |-- llm/lm.next_token (TextChunkPolicy: sentences, long clauses, a word bound) -->
                                  loop per chunk: agent/speech_input (the chunk's text -> the TTS's request) ->
                                  the TTS's own walk (fresh KV labels per chunk)
                                  |-- the TTS's own streams (frames -> codec windows -> audio)
```

A turn is one request: audio in (or a text turn: the last user message), then the transcript, the reply's tokens
and its audio come out as they are made (`agent:transcript`, `llm:next_token`, `tts:audio`). Cancelling it stops
all three parts at once. Nothing here knows a model: each role's part is held to a contract (checked when the
composition is built, the error naming the role): the ASR and the chat model follow the usual autoregressive walks
(`prefill` writing `next_token`, then `decode`, a `DynamicLoop`), take `audio` / `messages` in their requests and
carry a `tokenizer` in their extras; the TTS takes `input` (and `voice`) and plans one walk for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from mstar_core.compose.spec import CompositionSpec
from mstar_core.errors import ConfigError, RequestError
from mstar_core.graph import (
    Copy,
    DynamicLoop,
    Graph,
    GraphNode,
    NodeCall,
    Parallel,
    Sequential,
    StreamingGraphEdge,
    Walk,
)
from mstar_core.graph.compose import PartEnv, PartNames, map_calls
from mstar_core.graph.walk import iter_calls
from mstar_core.model import LoadedModel
from mstar_core.schema import RequestField, RequestSchema
from mstar_core.streaming import TextChunkPolicy

ROLES = ("asr", "llm", "tts")
GLUE = "agent"
#: what the composed model emits, by meaning (the realtime route reads these names from `extras["outputs"]`)
OUTPUTS = {"transcript": "agent:transcript", "prompt_ids": "agent:prompt_ids", "token": "llm:next_token",
           "audio": "tts:audio", "spoken_text": "agent:spoken_text"}
#: the request fields the chat model's part takes from a turn (checked by its own schema)
LLM_FIELDS = ("max_tokens", "temperature", "top_p", "seed")


def env(name: str) -> str:
    return f"{GLUE}:{name}"


def node(name: str) -> str:
    return f"{GLUE}/{name}"


# -- contracts ---------------------------------------------------------------------------------------------


def _fail(role: str, part: LoadedModel, what: str) -> None:
    raise ConfigError(f"voice_agent: role '{role}' (model '{part.name}') {what}")


def _ar_walks(role: str, part: LoadedModel) -> tuple[Walk, Walk]:
    walks = part.graph.walks
    if "prefill" not in walks or "decode" not in walks or not isinstance(walks["decode"].body, DynamicLoop):
        _fail(role, part, f"must follow the autoregressive walks (`prefill`, then `decode` as a DynamicLoop); its walks: "
                          f"{', '.join(walks)}")
    if "next_token" not in walks["prefill"].outputs:
        _fail(role, part, "must write `next_token` from its `prefill` walk")
    return walks["prefill"], walks["decode"]


def _field(role: str, part: LoadedModel, name: str) -> None:
    schema = part.request_schema
    if schema is None or not any(f.name == name for f in schema.fields):
        _fail(role, part, f"must take the request field '{name}'")


def _tokenizer(role: str, part: LoadedModel) -> Any:
    tokenizer = (part.extras or {}).get("tokenizer")
    if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
        _fail(role, part, "must carry its `tokenizer` (with decode) in its extras")
    return tokenizer


def _probe(role: str, part: LoadedModel, inputs: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return part.prepare_inputs(inputs)
    except Exception as exc:
        raise ConfigError(f"voice_agent: role '{role}' (model '{part.name}') refused a plain request {dict(inputs)}: "
                          f"{type(exc).__name__}: {exc}") from None


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


def _decoder(tokenizer: Any):
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


# -- the graph ------------------------------------------------------------------------------------------------


#: the options a deploy file may set (`options:` of the composed entry)
OPTIONS = {
    "min_clause_words": "a clause boundary ends a spoken piece once it holds this many words (default 6)",
    "max_words": "a piece with no boundary is cut after this many words (default 24)",
    "speech_options": "fields of the TTS's own request for every piece, under what a turn's speech_options sets",
    "transcript_max_tokens": "the most tokens of a turn's transcript, unless the turn says",
}


def _options(options: Mapping[str, Any], where: str = "options") -> dict[str, Any]:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: voice_agent has no such option; its options: {', '.join(OPTIONS)}")
    out = {"min_clause_words": 6, "max_words": 24, "speech_options": {}, "transcript_max_tokens": None, **options}
    for key in ("min_clause_words", "max_words", "transcript_max_tokens"):
        value = out[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{where}.{key} must be an integer >= 1, got {value!r}")
    if out["max_words"] < out["min_clause_words"]:
        raise ConfigError(f"{where}.max_words ({out['max_words']}) must be at least min_clause_words "
                          f"({out['min_clause_words']})")
    if not isinstance(out["speech_options"], Mapping) or "input" in out["speech_options"]:
        raise ConfigError(f"{where}.speech_options must be a mapping of the TTS's request fields (not 'input')")
    return out


def build(name: str, parts: Mapping[str, LoadedModel], options: Mapping[str, Any] | None = None) -> LoadedModel:
    opts = _options(options or {})
    asr_part, llm_part, tts_part = (parts[r] for r in ROLES)
    asr, llm, tts = (PartNames(r, parts[r].graph) for r in ROLES)
    asr_prefill, asr_decode = _ar_walks("asr", asr_part)
    llm_prefill, llm_decode = _ar_walks("llm", llm_part)
    _field("asr", asr_part, "audio")
    _field("llm", llm_part, "messages")
    _field("tts", tts_part, "input")
    asr_tokenizer, llm_tokenizer = _tokenizer("asr", asr_part), _tokenizer("llm", llm_part)
    speech_defaults = dict(opts["speech_options"])
    try:
        tts_part.prepare_inputs({"input": "Hello.", **speech_defaults})
    except Exception as exc:
        raise ConfigError(f"options.speech_options: model '{tts_part.name}' refuses {speech_defaults}: {exc}") from None
    tts_plan = tts_part.graph.plan(_probe("tts", tts_part, {"input": "Hello."}))
    if len(tts_plan) != 1:
        _fail("tts", tts_part, f"must speak a text in one walk; it plans {tts_plan}")
    speak = tts_part.graph.walks[tts_plan[0]]

    # what the glue hands each part: the keys of its own preparation that its walks read
    llm_reads = {*llm_prefill.inputs, *llm_prefill.optional_inputs, *llm_decode.optional_inputs}
    llm_keys = sorted(k for k in _probe("llm", llm_part, {"messages": [{"role": "user", "content": "Hi"}]})
                      if k in llm_reads)
    tts_reads = {*speak.inputs, *speak.optional_inputs}
    tts_probe = _probe("tts", tts_part, {"input": "Hello."})
    missing = [k for k in speak.inputs if k not in tts_probe]
    if missing:
        _fail("tts", tts_part, f"prepares no {missing}, which its walk '{speak.name}' needs")
    tts_keys = sorted(k for k in tts_probe if k in tts_reads)
    lm_node = next(iter_calls(llm_prefill.body)).node
    eos = {int(t) for t in llm_part.extras.get("eos_token_ids") or ()}
    decode_reply = _decoder(llm_tokenizer)

    # -- the ASR: its walks, the prefill and decode joined with the tokens kept
    asr_walks = [asr.walk_spec(w) for n, w in asr_part.graph.walks.items() if n not in ("prefill", "decode")]
    decode_loop = asr.step(asr_decode.body, "decode")
    decode_loop = attrs.evolve(decode_loop, accumulate={**decode_loop.accumulate,
                                                        asr.env("next_token"): env("asr_tokens")})
    transcribe = Walk(
        name="asr.transcribe",
        body=Sequential(asr.step(asr_prefill.body, "prefill"), Copy({env("first_token"): asr.env("next_token")}),
                        decode_loop),
        inputs=[asr.env(n) for n in asr_prefill.inputs],
        optional_inputs=sorted({asr.env(n) for n in (*asr_prefill.optional_inputs, *asr_decode.optional_inputs)}),
        outputs=(env("first_token"), env("asr_tokens")),
        description="the ASR's prompt and decode loop, its tokens kept for the chat model's prompt",
    )

    # -- the chat model's turn, and the TTS fed from its token stream
    prompt_call = NodeCall(node("prompt"), inputs={k: env(k) for k in ("messages", "llm_fields", "previous",
                                                                        "first_token", "asr_tokens")},
                           outputs={"transcript": env("transcript"), "prompt_ids": env("prompt_ids"),
                                    **{k: llm.env(k) for k in llm_keys}})
    think = Sequential(prompt_call, llm.step(llm_prefill.body, "prefill"), llm.step(llm_decode.body, "decode"))
    speech_input = NodeCall(node("speech_input"), inputs={"chunk": env("reply_chunk"), "tts_fields": env("tts_fields"),
                                                          "unspoken": env("unspoken"), "span": env("span")},
                            outputs={"speak_count": env("speak_count"), "text": env("spoken_text"),
                                     "span": env("span_after"), **{k: tts.env(k) for k in tts_keys}})
    # each chunk runs the TTS's walk afresh: its KV labels start empty (the first call of each kvcache node resets)
    speak_once = Parallel(_fresh_labels(tts.step(speak.body, speak.name), tts_part.graph, tts),
                          count=env("speak_count"), index_name=env("speak_index"), collect=())
    reply_chunk = env("reply_chunk")
    to_speech = StreamingGraphEdge(
        f"{llm.node(lm_node)}.next_token",
        policy=TextChunkPolicy(decode_reply, min_clause_words=opts["min_clause_words"], max_words=opts["max_words"]),
        keep=lambda token: int(token) not in eos, into=reply_chunk,
        consumer=DynamicLoop(body=Sequential(speech_input, speak_once), until=lambda e: e[reply_chunk].final,
                             max_iters=env("max_chunks"), index_name=env("chunk_index"),
                             carry={env("span_after"): env("span")}),
    )
    llm_optional = sorted({llm.env(n) for n in (*llm_prefill.optional_inputs, *llm_decode.optional_inputs)})
    turn_inputs = (env("messages"), env("llm_fields"), env("previous"))
    heard = (env("first_token"), env("asr_tokens"))
    respond = Walk(
        name="respond", body=think, inputs=(*turn_inputs, env("tts_fields"), env("max_chunks"), env("unspoken"),
                                            env("span")),
        optional_inputs=(*heard, *llm_optional, *sorted(tts.env(n) for n in speak.optional_inputs)),
        emit=(OUTPUTS["transcript"], OUTPUTS["prompt_ids"], OUTPUTS["token"], OUTPUTS["spoken_text"], OUTPUTS["audio"]),
        # the TTS's own streams (frames -> codec windows) end a segment with each piece: its last window is decoded
        # as the piece ends, not held for the next piece's frames, and no window reaches back into the last piece
        streams=(to_speech, *(attrs.evolve(tts.stream(e, speak.name, k), segment_by=env("chunk_index"))
                              for k, e in enumerate(speak.streams))),
        description="the chat model answers the turn; each sentence of its reply is spoken as it is written",
    )
    respond_text = Walk(
        name="respond_text", body=think, inputs=turn_inputs, optional_inputs=(*heard, *llm_optional),
        emit=(OUTPUTS["transcript"], OUTPUTS["prompt_ids"], OUTPUTS["token"]),
        description="the chat model answers the turn in text",
    )
    glue = [
        GraphNode(node("prompt"), inputs=("messages", "llm_fields", "previous"),
                  optional_inputs=("first_token", "asr_tokens"), outputs=("transcript", "prompt_ids", *llm_keys),
                  engine="function", module=lambda: AgentPrompt(asr_tokenizer, llm_part, llm_keys)),
        GraphNode(node("speech_input"), inputs=("chunk", "tts_fields"), optional_inputs=("unspoken", "span"),
                  outputs=("speak_count", "text", "span", *tts_keys),
                  engine="function", module=lambda: SpeechInput(decode_reply, tts_part, tts_keys)),
    ]

    def plan(request: Mapping[str, Any]) -> list[str]:
        walks = asr_plan(asr_part.graph, request) if request.get(env("has_audio")) else []
        return [*walks, "respond" if request.get(env("speak"), True) else "respond_text"]

    graph = Graph.build(name, [*asr.nodes(), *llm.nodes(), *tts.nodes(), *glue],
                        [*asr_walks, transcribe, respond, respond_text], plan=plan)
    max_chunks = int(llm_part.extras.get("max_model_len") or 32768) + 1
    request = AgentRequest(parts, asr, max_chunks, speech_defaults, opts["transcript_max_tokens"])
    return LoadedModel(
        name=name, graph=graph, random_weights=any(p.random_weights for p in parts.values()), prepare=request,
        request_schema=request.schema,
        extras={"composition": "voice_agent", "outputs": dict(OUTPUTS), "eos_token_ids": sorted(eos),
                "reply_tokenizer": llm_tokenizer, "sample_rate": int(tts_part.extras.get("sample_rate", 24000)),
                "asr_sample_rate": int(asr_part.extras.get("sample_rate", 16000)),
                "voices": list(tts_part.extras.get("voices") or ())},
    )


def _fresh_labels(step: Any, part_graph: Graph, names: PartNames) -> Any:
    """`step` with the first call of each of the part's kvcache nodes resetting its label (unless it says)."""
    seen: set[str] = set()

    def fresh(call: NodeCall) -> NodeCall:
        inner = call.node.split("/", 1)[1]
        if part_graph.nodes[inner].engine != "kvcache" or call.node in seen:
            return call
        seen.add(call.node)
        if "reset" in call.options:
            return call
        return attrs.evolve(call, options={**call.options, "reset": True})

    return map_calls(step, fresh)


SPEC = CompositionSpec(
    "voice_agent", ROLES, build,
    description="speech in, speech out: an ASR's transcript into a chat model's turn, its reply spoken by a TTS "
                "sentence by sentence while it is written; one request per turn",
    role_help={"asr": "a speech recognizer, e.g. whisper", "llm": "a chat model, e.g. llama",
               "tts": "a text-to-speech model, e.g. qwen3-tts"},
    options=OPTIONS,
)
