"""`n` choices for each prompt of a text request: submission, per-choice text and log-probabilities, and one
stream of events merged from all of them (what the chat and completions routes share).

A model whose request schema takes `n` (the `llama` family) serves `n > 1` as one request per prompt: one
prefill of the prompt, then `n` copy-on-write forks of its KV cache decoding side by side, each emitted
token carrying its choice (`Output.branch`); `SharedRequest` splits that one stream into one per choice.
Any other model gets `n` requests on the same prompt: choice 0 is submitted alone; once its first output
arrives its prompt is in the engine's prefix cache, so the other choices, submitted then, share those pages.
Either way choice `i` samples with `seed + i`, exactly what a single request seeded so samples.

Nothing here buffers without bound for a slow client: each choice's stream of events waits while
`EVENTS_AHEAD` of its events are unsent (the route's body generator is as slow as the client's socket),
and a shared request's branches each hold at most `EVENTS_AHEAD` outputs, so the request's own credit
(`runtime.request.MAX_UNREAD`) holds its producer back in turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from fastapi import Request

from mstar_core.api.http.errors import ApiError
from mstar_core.api.requests.submit import (
    first_then_rest,
    map_result,
    request_priority,
    sse,
    stream_error_payload,
    submit,
    watch_disconnect,
)
from mstar_core.api.requests.text import TextAssembler
from mstar_core.compat import changed
from mstar_core.sampling import choice_seed  # noqa: F401  (chat reads it from here)

#: Events (or a branch's outputs) one choice may have waiting for the client before its reading waits too.
EVENTS_AHEAD = 64

#: One generated token with what the model said of it: (token id, its logprob, [(alternative id, logprob), ...]).
TokenLogprob = tuple[int, float | None, list[tuple[int, float]] | None]


class Choice:
    """One choice: its request, its text so far, and the log-probabilities of the tokens in that text."""

    def __init__(self, index: int, prompt: int, handle: Any, adapter: Any, stops: list[str], max_tokens: int | None,
                 audio: Any = None, ignore_eos: bool = False):
        self.index = index
        self.prompt = prompt  # which prompt of the request this choice answers
        self.handle = handle
        self.adapter = adapter
        self.text = TextAssembler(adapter, stops, max_tokens, ignore_eos)
        self.first: Any = None
        self.rest: AsyncIterator[Any] | None = None
        self.logprobs: list[TokenLogprob] = []  # one per token of the text
        self.unsent = 0  # logprobs[unsent:] have not been reported yet
        self._logprob: float | None = None
        self._top: list[tuple[int, float]] | None = None
        # a spoken reply (`chat_audio.AudioReply`): the request runs on after the text ends, until the audio does
        self.audio = audio

    @property
    def finish_reason(self) -> str | None:
        return self.text.finish_reason

    @property
    def settled(self) -> bool:
        """Whether nothing more is wanted from the request (its text is over and no audio is awaited)."""
        return self.text.finish_reason is not None and self.audio is None

    @property
    def transcript(self) -> str:
        """What a spoken reply says: its own transcript output, or else the reply's text."""
        if self.audio is not None and self.audio.transcript_output is not None:
            return self.audio.transcript
        return self.text.text

    def has_audio(self) -> bool:
        return self.audio is not None and bool(self.audio.pending)

    def feed(self, out: Any) -> str:
        """Take one output of the request; return newly final text. A finished choice cancels its request (its branch).

        With a spoken reply the text returned is the transcript's (the reply's text, or its transcript output).
        """
        if out is None:
            return ""
        if self.audio is not None:
            piece = self.audio.feed(out)
            if piece is not None:
                return piece
        if self.text.finish_reason is not None:
            return ""
        if out.name == self.adapter.logprob_output:
            self._logprob = None if out.value is None else float(out.value)
            return ""
        if out.name == self.adapter.top_logprobs_output:
            self._top = [(int(t), float(lp)) for t, lp in out.value] if out.value is not None else None
            return ""
        if out.name != self.adapter.token_output:
            return ""
        token = int(out.value)
        before = len(self.text.ids)
        delta = self.text.feed(token)
        if len(self.text.ids) > before:  # part of the text (a stop token is not, and so has no entry)
            self.logprobs.append((token, self._logprob, self._top))
        self._logprob = self._top = None
        if self.settled:
            self.handle.cancel()  # stop string, EOS or max_tokens reached: free the request now
        if self.audio is not None and self.audio.transcript_output is not None:
            return ""  # the tokens count (usage), the transcript output says what was spoken
        return delta

    def close(self, env: Mapping[str, Any]) -> str:
        tail = self.text.close(env)
        if self.audio is None:
            return tail
        late = self.audio.finish(env)
        return late if self.audio.transcript_output is not None else tail

    def take_logprobs(self) -> list[TokenLogprob]:
        """The entries not streamed yet (and mark them sent)."""
        out = self.logprobs[self.unsent:]
        self.unsent = len(self.logprobs)
        return out


class SharedRequest:
    """One request whose `n` fan-out branches are `n` choices: its outputs sorted into one stream per branch."""

    def __init__(self, handle: Any, n: int):
        self.handle = handle
        self.queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(n)]
        self.open = set(range(n))  # branches whose choice has not finished yet
        self.cancelled = False
        self._taken = asyncio.Event()  # set whenever a branch's reader takes an output (or a branch finishes)
        self.pump = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        end: BaseException | None = None
        try:
            async for out in self.handle:
                i = out.branch
                if i is None or not 0 <= i < len(self.queues):
                    continue
                # a branch EVENTS_AHEAD behind holds the pump, and so the request (its reader's credit); a
                # finished branch's outputs are dropped, so it never holds the others
                while i in self.open and self.queues[i].qsize() >= EVENTS_AHEAD:
                    self._taken.clear()
                    await self._taken.wait()
                if i in self.open:
                    self.queues[i].put_nowait(out)
        except BaseException as exc:  # the request failed (or was cancelled): every branch's stream ends so
            end = exc
        for queue in self.queues:
            queue.put_nowait(_End(None if self.cancelled else end))

    def branch(self, i: int) -> BranchHandle:
        return BranchHandle(self, i)

    def finish(self, i: int) -> None:
        """Choice `i` needs nothing more; once every choice is done the request stops."""
        self.open.discard(i)
        queue = self.queues[i]
        ended = None
        while not queue.empty():  # nobody reads its outputs now (a request's end is kept for a late reader)
            item = queue.get_nowait()
            ended = item if isinstance(item, _End) else ended
        if ended is not None:
            queue.put_nowait(ended)
        self._taken.set()
        if not self.open:
            self.cancelled = True
            self.handle.cancel()


class _End:
    def __init__(self, error: BaseException | None):
        self.error = error


class BranchHandle:
    """One choice of a `SharedRequest`, with a request handle's interface (iterate, `result()`, `cancel()`)."""

    def __init__(self, shared: SharedRequest, index: int):
        self.shared = shared
        self.index = index

    @property
    def prepared(self) -> Any:
        return self.shared.handle.prepared

    def cancel(self) -> None:
        self.shared.finish(self.index)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Any:
        item = await self.shared.queues[self.index].get()
        self.shared._taken.set()
        if isinstance(item, _End):
            self.shared.queues[self.index].put_nowait(item)  # later iterations end too
            if item.error is not None and not isinstance(item.error, asyncio.CancelledError):
                raise item.error
            raise StopAsyncIteration
        return item

    async def result(self) -> dict[str, Any]:
        """The request's final env as this choice saw it (the fan-out joins each name as a list, one per branch)."""
        env = await self.shared.handle.result()
        reasons = env.get("finish_reason")
        ok = isinstance(reasons, list) and self.index < len(reasons)
        return {"finish_reason": reasons[self.index] if ok else None}


def forks_choices(adapter: Any) -> bool:
    """Whether the adapter's model draws `n` outputs of one request itself (its schema says so: `draws_n`)."""
    schema = getattr(getattr(adapter, "loaded", None), "request_schema", None)
    if schema is None:
        return False
    if getattr(schema, "draws_n", False):
        return True
    if any(f.name == "n" for f in schema.fields):  # the guess of plugin API 1.0: warns in 1.1, errors from 1.2
        changed("n_field_draws_n")
        return True
    return False


async def start_choices(request: Request, state: Any, model: str, adapter: Any, prompts: list[Any], n: int,
                        inputs_for: Callable[[Any, int], dict[str, Any]], stops: list[str],
                        max_tokens: int | None, started: float | None = None,
                        make_audio: Callable[[], Any] | None = None) -> list[Choice]:
    """Submit `n` choices for each prompt (`inputs_for(prompt, i)` gives choice i's raw inputs) and wait for the
    first output of each choice 0 before submitting its siblings (so they find its prompt pages cached).
    `make_audio()` gives each choice its spoken reply (`chat_audio.AudioReply`) when the request asks for audio.

    Choices are numbered prompt by prompt (`prompt * n + i`), as OpenAI numbers them. Whatever fails
    here cancels every choice already submitted.
    """
    choices: list[Choice] = []
    shared: list[SharedRequest] = []
    forks = n > 1 and forks_choices(adapter)
    priority = request_priority(request)  # a Batch API line's is background: live requests go first

    async def add(p: int, i: int) -> Choice:
        inputs = inputs_for(prompts[p], i)
        handle = await submit(state, model, inputs, priority=priority)
        choice = Choice(p * n + i, p, handle, adapter, stops, max_tokens, make_audio() if make_audio else None,
                        ignore_eos=bool(inputs.get("ignore_eos")))
        choices.append(choice)
        return choice

    async def add_forks(p: int) -> list[Choice]:
        # one request: the seed it carries is choice 0's; the engine gives branch i seed + i
        inputs = {**inputs_for(prompts[p], 0), "n": n}
        handle = await submit(state, model, inputs, priority=priority)
        request = SharedRequest(handle, n)
        shared.append(request)
        ignore_eos = bool(inputs.get("ignore_eos"))
        own = [Choice(p * n + i, p, request.branch(i), adapter, stops, max_tokens, ignore_eos=ignore_eos)
               for i in range(n)]
        choices.extend(own)
        return own

    async def prime(choice: Choice) -> None:
        choice.first, choice.rest = await first_then_rest(request, choice.handle)

    try:
        if forks:
            groups = [await add_forks(p) for p in range(len(prompts))]
            leaders = [g[0] for g in groups]
            followers = [c for g in groups for c in g[1:]]
        else:
            leaders = [await add(p, 0) for p in range(len(prompts))]
        await asyncio.gather(*(prime(c) for c in leaders))
        if started is not None and not priority:  # (a batch line's wait is no live client's time to first token)
            observe_ttft(state, model, started)
        if not forks:
            followers = [await add(p, i) for p in range(len(prompts)) for i in range(1, n)]
        await asyncio.gather(*(prime(c) for c in followers))
    except BaseException:
        for choice in choices:
            choice.handle.cancel()
        raise
    choices.sort(key=lambda c: c.index)
    return choices


#: What a running choice reports: (choice, newly final text, the log-probabilities of the tokens since the last
#: report, done).
Event = tuple[Choice, str, list[TokenLogprob], bool]


async def run_choice(choice: Choice, emit: Callable[[Event], Awaitable[None]] | None = None) -> None:
    """Feed a started choice to its end; `emit` each piece of text (and once, done) with its tokens' logprobs.

    `emit` is awaited: while the client is behind, the choice reads no more of its request.
    """
    delta = choice.feed(choice.first)
    if (delta or choice.has_audio()) and emit is not None:
        await emit((choice, delta, choice.take_logprobs(), False))
    if not choice.settled:
        async for out in choice.rest:
            delta = choice.feed(out)
            if (delta or choice.has_audio()) and emit is not None:
                await emit((choice, delta, choice.take_logprobs(), False))
            if choice.settled:
                break
    env = await choice.handle.result() if not choice.settled else {}
    choice.handle.cancel()
    tail = choice.close(env)
    if emit is not None:
        await emit((choice, tail, choice.take_logprobs(), True))


async def run_all(request: Request, choices: list[Choice]) -> None:
    """Run every choice to its end (no streaming); a client that goes away cancels them all (499)."""
    work = asyncio.ensure_future(asyncio.gather(*(run_choice(c) for c in choices)))
    watcher = asyncio.ensure_future(watch_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            raise ApiError(499, "client disconnected")
        map_result(work)
    finally:
        watcher.cancel()
        work.cancel()
        # a cancelled gather ends with an exception (CancelledError, or a choice's failure) nobody awaits: retrieved
        # here, so a client's disconnect does not log "_GatheringFuture exception was never retrieved"
        work.add_done_callback(_retrieve)
        for choice in choices:
            choice.handle.cancel()


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class _Ended:
    """A choice's run ended (`error`: what failed it)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None):
        self.error = error


async def _run_into(choice: Choice, queue: asyncio.Queue) -> None:
    try:
        await run_choice(choice, queue.put)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        await queue.put(_Ended(exc))
        return
    await queue.put(_Ended(None))


async def events(choices: list[Choice]) -> AsyncIterator[Event]:
    """Every choice's events as they come, interleaved; raises what failed any of them.

    At most `EVENTS_AHEAD` events per choice wait here: a client reading slowly holds the choices back.
    """
    queue: asyncio.Queue = asyncio.Queue(maxsize=EVENTS_AHEAD * max(1, len(choices)))
    tasks = [asyncio.ensure_future(_run_into(c, queue)) for c in choices]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if isinstance(item, _Ended):
                remaining -= 1
                if item.error is not None:
                    raise item.error
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        for choice in choices:
            choice.handle.cancel()


def count_prompts(adapter: Any, choices: list[Choice]) -> int:
    """Prompt tokens of the request, each prompt counted once however many choices it has."""
    seen: dict[int, int] = {}
    for choice in choices:
        if choice.prompt not in seen:
            seen[choice.prompt] = adapter.prompt_tokens({}, choice.handle.prepared)
    return sum(seen.values())


def usage(adapter: Any, choices: list[Choice]) -> dict[str, int]:
    prompt = count_prompts(adapter, choices)
    completion = sum(c.text.generated for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def observe_ttft(state: Any, model: str, started: float) -> None:
    if state.metrics is not None:
        state.metrics.ttft.labels(model).observe(time.perf_counter() - started)


def check_n(state: Any, n: int) -> None:
    cap = state.config.max_n
    if n > cap:
        raise ApiError(400, f"'n' is {n}; this server returns at most {cap} choices per prompt "
                            "(mstar serve --max-n raises the cap)", param="n")



async def sse_body(chunks: AsyncIterator[bytes], choices: list[Any], usage: Callable[[], bytes] | None = None
                   ) -> AsyncIterator[bytes]:
    """An SSE body: the route's chunks, the usage chunk if asked, an error event if a choice fails, then [DONE].

    Every choice's request is cancelled at the end, whatever happened (a client gone, an error).
    """
    try:
        async for data in chunks:
            yield data
        if usage is not None:
            yield usage()
    except Exception as exc:
        yield sse(stream_error_payload(exc))
    finally:
        for c in choices:
            c.handle.cancel()
    yield sse("[DONE]")
