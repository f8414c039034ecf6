"""Structured outputs' cost: SmolLM2-135M (the `smollm2` preset, real weights) decoding 32 rows at once, every
row under a JSON-schema grammar vs every row free, in the same run (A B A B), through the runtime as served.

Decode tokens/s at batch 32 is measured from each token's arrival: the window runs from the moment every row
has its first token to the moment the first row ends, and counts the tokens all rows got inside it (so rows that
finish early, as grammar rows may, do not turn the figure into one of a smaller batch). Also reported: each
schema's compile time (cold, xgrammar, this vocabulary), and the fraction of grammar rows whose output parses
and validates (jsonschema) in a separate pass with room to finish.

    python benchmarks/structured.py [--quick]

Final line: JSON with `constrained_vs_free_c32`, `compile_ms_max`, `schema_valid_fraction`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Long-running outputs for the rate window (free strings and arrays), and short records for validity.
STORY = {"type": "object", "properties": {"title": {"type": "string"}, "story": {"type": "string"},
                                          "tags": {"type": "array", "items": {"type": "string"}}},
         "required": ["title", "story", "tags"], "additionalProperties": False}
#: Bounded records (string lengths, item counts, ranges, enums): finite languages, so each row can finish.
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "role": {"enum": ["chef", "pilot", "teacher", "doctor", "other"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}
ITEMS = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
    "type": "object", "properties": {"sku": {"enum": ["A1", "B2", "C3"]}, "qty": {"type": "integer", "minimum": 1,
                                                                              "maximum": 99}},
    "required": ["sku", "qty"], "additionalProperties": False}}, "paid": {"type": "boolean"}},
    "required": ["items", "paid"], "additionalProperties": False}
SCHEMAS = {"story": STORY, "person": PERSON, "items": ITEMS}
TOPICS = ["a lighthouse", "a robot chef", "the sea", "a lost key", "winter", "a city at night", "a dragon", "trains"]


def uptime() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


async def run_batch(engine, tok, template, rows: int, max_tokens: int, grammar,
                    ask: str = "Write a long story about {} as JSON (variant {}).") -> tuple[list[list[float]], list]:
    """`rows` chat requests at once; each row's token arrival times and (text, finish reason)."""
    from mstar_llm.chat import render_chat

    async def one(i: int):
        prompt = render_chat(template, [{"role": "user", "content": ask.format(TOPICS[i % 8], i)}])
        inputs = {"input_ids": tok.encode(prompt, add_special_tokens=False).ids, "max_tokens": max_tokens,
                  "temperature": 0.7, "seed": i}
        if grammar is not None:
            inputs["grammar"] = grammar
        handle = await engine.submit_async("llama", inputs)
        times, ids = [], []
        async for out in handle:
            if out.name == "next_token":
                times.append(time.perf_counter())
                ids.append(int(out.value))
        env = await handle.result()
        return times, (tok.decode(ids, skip_special_tokens=True), env.get("finish_reason"))

    got = await asyncio.gather(*(one(i) for i in range(rows)))
    return [g[0] for g in got], [g[1] for g in got]


def window_rate(times: list[list[float]]) -> tuple[float, int]:
    """Tokens/s over the window in which every row is decoding, and the decode steps it spans."""
    start = max(t[0] for t in times if t)
    end = min(t[-1] for t in times if t)
    if end <= start:
        return 0.0, 0
    count = sum(sum(1 for x in t if start < x <= end) for t in times)
    return count / (end - start), round(count / len(times))


async def main(args) -> dict:
    import jsonschema

    from mstar_core.grammar import GrammarSpec
    from mstar_core.grammar.check import check_json_schema
    from mstar_core.grammar.compile import compiled
    from mstar_core.model import LoadOptions
    from mstar_core.runtime import AsyncEngine

    rows = 32
    result: dict = {"rows": rows, "load_before": uptime()}
    async with AsyncEngine() as engine:
        t0 = time.perf_counter()
        loaded = await engine.load_model("llama", LoadOptions(preset="smollm2"),
                                         settings={"lm": {"max_num_seqs": rows}})
        result["load_s"] = round(time.perf_counter() - t0, 1)
        tok, template, vocab = loaded.extras["tokenizer"], loaded.extras["chat_template"], loaded.extras["grammar_vocab"]
        t = time.perf_counter()
        await asyncio.to_thread(compiled, vocab, GrammarSpec("json_object"))  # the vocabulary's compiler is built once
        result["compiler_setup_ms"] = round((time.perf_counter() - t) * 1e3, 1)
        compile_ms = {}
        for name, schema in SCHEMAS.items():
            spec = GrammarSpec("json_schema", check_json_schema(schema, name))
            t = time.perf_counter()
            await asyncio.to_thread(compiled, vocab, spec)
            compile_ms[name] = round((time.perf_counter() - t) * 1e3, 1)
        result["compile_ms"] = compile_ms
        story = ["json_schema", json.dumps(STORY)]
        await run_batch(engine, tok, template, 4, 4, story)  # warm both paths
        await run_batch(engine, tok, template, 4, 4, None)
        rates: dict[str, list[float]] = {"free": [], "constrained": []}
        steps: dict[str, list[int]] = {"free": [], "constrained": []}
        for _ in range(args.pairs):
            for kind, grammar in (("free", None), ("constrained", story)):
                times, _ = await run_batch(engine, tok, template, rows, args.decode_tokens, grammar)
                rate, n = window_rate(times)
                rates[kind].append(rate)
                steps[kind].append(n)
        result["tokens_per_s_c32"] = {k: [round(r, 1) for r in v] for k, v in rates.items()}
        result["window_steps"] = steps
        # validity: every row under a record schema, with room to finish
        valid = total = 0
        for name in ("person", "items"):
            _, outs = await run_batch(engine, tok, template, args.valid_rows, args.valid_tokens,
                                      ["json_schema", json.dumps(SCHEMAS[name])], "Give me a JSON record about {}.")
            for text, _reason in outs:
                total += 1
                try:
                    jsonschema.validate(json.loads(text), SCHEMAS[name])
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
    free, constrained = statistics.median(rates["free"]), statistics.median(rates["constrained"])
    result.update(constrained_vs_free_c32=round(constrained / free, 3) if free else None,
                  compile_ms_max=max(compile_ms.values()), schema_valid_fraction=round(valid / total, 3),
                  valid_rows=total, load_after=uptime())
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one A B pair, short windows (< 60 s)")
    args = parser.parse_args()
    args.pairs = 1 if args.quick else 3
    args.decode_tokens = 24 if args.quick else 64
    args.valid_rows = 8 if args.quick else 32
    args.valid_tokens = 128
    print(json.dumps(asyncio.run(main(args))))
