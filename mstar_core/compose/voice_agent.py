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

from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.compose.spec import CompositionSpec
from mstar_core.compose.voice_names import OUTPUTS, ROLES, env, node
from mstar_core.compose.voice_turn import (
    AgentPrompt,
    AgentRequest,
    SpeechInput,
    asr_plan,
    decoder,
)
from mstar_core.errors import ConfigError
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
from mstar_core.graph.compose import PartNames, map_calls
from mstar_core.graph.walk import iter_calls
from mstar_core.model import LoadedModel
from mstar_core.streaming import TextChunkPolicy

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
    decode_reply = decoder(llm_tokenizer)

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
