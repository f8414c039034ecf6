"""The voice agent composed of Whisper, llama and Qwen3-TTS (tiny presets): one request per turn, the parts' weights
and engines shared, the reply's text spoken chunk by chunk as it is written, cancellation stopping every part, and a
second turn prefilling only its new tokens."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import torch

from mstar_core.errors import RequestError

SPEECH = {"max_frames": 12}  # tiny random TTS: a bound on each piece's frames keeps a turn short


def turn(served, inputs):
    """(outputs in order as (name, value, seconds since submit), final env)."""
    async def go():
        t0 = time.perf_counter()
        handle = await served.engine.submit_async("agent", inputs)
        outs = [(o.name, o.value, time.perf_counter() - t0) async for o in handle]
        return outs, await handle.result()
    return served.run(go())


def test_the_parts_weights_and_engines_are_the_standalone_models(served):
    engine = served.engine
    agent = engine.models["agent"]
    composed = engine.node_engines("agent")
    for role, model in (("asr", "whisper"), ("llm", "llama"), ("tts", "qwen3-tts")):
        part = engine.models[model]
        for name in part.graph.nodes:
            assert composed[f"{role}/{name}"] is engine.node_engines(model)[name]
            assert engine.node_schedulers("agent")[f"{role}/{name}"] is engine.node_schedulers(model)[name]
    # the very same tensors: one copy of every weight
    for composed_node, part_model, node in (("llm/lm", "llama", "lm"), ("asr/decoder", "whisper", "decoder"),
                                           ("tts/talker", "qwen3-tts", "talker")):
        mine = {p.data_ptr() for p in agent.graph.nodes[composed_node].module().parameters()}
        theirs = {p.data_ptr() for p in engine.models[part_model].graph.nodes[node].module().parameters()}
        assert mine and mine == theirs
    own = set(composed) - {n for n in composed if n.split("/")[0] in ("asr", "llm", "tts")}
    assert own == {"agent/prompt", "agent/speech_input"}  # only the glue has engines of its own


def test_a_spoken_turn_gives_transcript_then_reply_tokens_and_speech_of_exactly_that_reply(served):
    outs, env = turn(served, {"audio": torch.randn(16000) * 0.1, "max_tokens": 48, "transcript_max_tokens": 4,
                              "speech_options": SPEECH, "temperature": 0})
    names = [n for n, _, _ in outs]
    assert names[0] == "agent:transcript" and isinstance(outs[0][1], str)
    tokens = [int(v) for n, v, _ in outs if n == "llm:next_token"]
    assert 1 <= len(tokens) <= 48 and names.index("agent:transcript") < names.index("llm:next_token")
    tokenizer = served.engine.models["llama"].extras["tokenizer"]
    eos = set(served.engine.models["agent"].extras["eos_token_ids"])
    reply = tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True)
    spoken = [v for n, v, _ in outs if n == "agent:spoken_text"]
    # every piece spoken is the reply's text, in order, nothing lost (pieces are stripped of outer whitespace)
    assert "".join(spoken).replace(" ", "") == reply.replace(" ", "").replace("\n", "")
    audio = [v for n, v, _ in outs if n == "tts:audio"]
    if spoken:
        assert audio and all(a.numel() > 0 for a in audio)
    if len(spoken) > 1:  # a piece cut mid-reply is spoken while the chat model still writes
        first_audio = next(t for n, _, t in outs if n == "tts:audio")
        last_token = max(t for n, _, t in outs if n == "llm:next_token")
        first_piece = next(t for n, _, t in outs if n == "agent:spoken_text")
        assert first_piece < last_token
        assert first_audio > 0
    assert env["agent:transcript"] == outs[0][1]


def test_a_second_turn_prefills_only_its_new_tokens(served):
    lm = served.engine.node_engines("llama")["lm"]
    tokenizer = served.engine.models["llama"].extras["tokenizer"]
    eos = set(served.engine.models["agent"].extras["eos_token_ids"])
    first = [{"role": "user", "content": "Tell me about the sea, please."}]
    outs, _ = turn(served, {"messages": first, "speak": False, "max_tokens": 40, "temperature": 0})
    prompt = next(v for n, v, _ in outs if n == "agent:prompt_ids")
    reply = [int(v) for n, v, _ in outs if n == "llm:next_token" and int(v) not in eos]
    text = tokenizer.decode(reply, skip_special_tokens=True)
    second = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "And the rivers?"}]
    before = dict(lm.stats())
    outs2, _ = turn(served, {"messages": second, "speak": False, "max_tokens": 4, "temperature": 0,
                             "previous_prompt_ids": prompt, "previous_reply_ids": reply})
    after = lm.stats()
    prompt2 = next(v for n, v, _ in outs2 if n == "agent:prompt_ids")
    assert prompt2[:len(prompt) + len(reply)] == prompt + reply  # the reply as generated, not re-tokenized
    generated = sum(1 for n, _, _ in outs2 if n == "llm:next_token")
    prefilled = after["tokens_forwarded"] - before["tokens_forwarded"] - (generated - 1)
    page = lm.settings.page_size
    history = len(prompt) + len(reply)
    # only the new tokens (and what fills the last, partly written page of the history) are computed again
    assert prefilled <= len(prompt2) - history + page, (prefilled, len(prompt2), history)
    assert after["kv_prefix_hit_pages"] - before["kv_prefix_hit_pages"] >= history // page - 1


def test_cancelling_a_turn_stops_every_part_and_frees_its_pages(served):
    engine = served.engine
    kv = {(m, n): e for m in ("whisper", "llama", "qwen3-tts") for n, e in engine.node_engines(m).items()
          if "kv_pages_used" in e.stats()}

    async def go():
        handle = await engine.submit_async("agent", {"audio": torch.randn(16000) * 0.1, "max_tokens": 200,
                                                     "speech_options": {"max_frames": 200}, "transcript_max_tokens": 4})
        async for out in handle:
            if out.name == "llm:next_token":
                break
        handle.cancel()
        with pytest.raises((asyncio.CancelledError, Exception)):
            await handle.result()
        await asyncio.sleep(0.2)
        return handle.request_id

    rid = served.run(go())
    for (model, node), e in kv.items():
        assert rid not in e.active_requests(), f"{model}/{node} still holds the cancelled turn"


def test_a_bad_turn_is_refused_naming_the_field(served):
    engine = served.engine

    async def prepare(inputs):
        return await engine.prepare("agent", inputs)

    with pytest.raises(RequestError, match="send 'audio'") as err:
        served.run(prepare({"messages": [{"role": "assistant", "content": "hi"}]}))
    assert err.value.param == "audio"
    with pytest.raises(RequestError, match="speech_options") as err:
        served.run(prepare({"messages": [{"role": "user", "content": "hi"}], "speech_options": {"input": "x"}}))
    with pytest.raises(RequestError, match="volume"):
        served.run(prepare({"messages": [{"role": "user", "content": "hi"}], "volume": 3}))
    with pytest.raises(RequestError, match="voice"):
        served.run(prepare({"messages": [{"role": "user", "content": "hi"}], "voice": "nobody-at-all"}))


def test_a_tool_call_in_the_reply_is_not_spoken_even_across_pieces():
    from mstar_core.compose.voice_turn import spoken_part

    marks = [("<tool_call>", "</tool_call>")]
    assert spoken_part("Let me look. <tool_call>\n{\"name\": \"w\"}\n</tool_call> Done.", marks, -1) == \
        ("Let me look.  Done.", -1)
    # a call that opens in one piece and closes in a later one: the span is carried between them
    assert spoken_part("Sure. <tool_call>\n{\"name\":", marks, -1) == ("Sure. ", 0)
    assert spoken_part(" \"w\", \"arguments\": {}}", marks, 0) == ("", 0)
    assert spoken_part("}\n</tool_call> It is sunny.", marks, 0) == (" It is sunny.", -1)
    assert spoken_part("no markers at all", [], -1) == ("no markers at all", -1)


def test_unspoken_spans_reach_the_turn_and_are_checked(served):
    outs, _ = turn(served, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
                            "speech_options": SPEECH, "unspoken": [["<tool_call>", "</tool_call>"]]})
    assert any(n == "llm:next_token" for n, _, _ in outs)
    with pytest.raises(RequestError, match="pairs") as err:
        served.run(served.engine.prepare("agent", {"messages": [{"role": "user", "content": "hi"}],
                                                   "unspoken": [["<x>"]]}))
    assert err.value.param == "unspoken"


def test_every_walk_of_the_composed_model_draws(served):
    from mstar_core.graph import to_dot, to_mermaid

    graph = served.engine.models["agent"].graph
    for walk in graph.walks:
        mermaid, dot = to_mermaid(graph, walk), to_dot(graph, walk)
        ids = re.findall(r"^\s*([^\s\[(\"]+)[\[(]", mermaid, re.M)  # each box's id, before its label
        assert ids and all(re.fullmatch(r"\w+", i) for i in ids), ids
        assert dot
    respond = to_mermaid(graph, "respond")
    for box in ("agent/prompt", "llm/lm", "agent/speech_input", "tts/talker", "tts/code2wav"):
        assert box in respond
