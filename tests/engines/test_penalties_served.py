"""Presence and frequency penalties count the tokens a request generated, not its prompt (OpenAI's rule)."""

from __future__ import annotations

from mstar_core.sampling import SamplingParams
from tests.engines.driver import generate, make_engine


def test_presence_and_frequency_penalties_leave_prompt_tokens_alone(llama_pair):
    _, ours = llama_pair
    engine = make_engine(ours, num_pages=32)
    # a prompt whose greedy first token already occurs in it: counting the prompt would push it down
    prompt, first = next(
        (p, t) for p in ([k] * 6 for k in range(1, 200))
        for t in [generate(engine, {"probe": p}, 1)["probe"][0]] if t in p
    )
    penalised = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0, max_tokens=4)
    out = generate(engine, {"r": prompt}, 4, inputs={"r": {"sampling": penalised}})["r"]
    assert out[0] == first  # nothing generated yet: no penalty on the first token
    # later tokens are penalised for what was generated: the first token is not greedily repeated forever
    plain = generate(engine, {"g": prompt}, 4)["g"]
    if plain[:2] == [first, first]:
        assert out[1] != first
    assert engine.pool.num_used == 0
