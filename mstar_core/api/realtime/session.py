"""One realtime session: its settings, input audio buffer, turn detection, conversation and response in flight,
and the client events that change them. Every bad client event raises `EventError` (an `error` event naming
it goes out; the session goes on)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import numpy as np

from mstar_core.api.http.bodies import json_bytes
from mstar_core.api.http.off_loop import LARGE_BYTES, release_freed_memory
from mstar_core.api.realtime import config as cfg
from mstar_core.api.realtime.bridge import ModelBridge
from mstar_core.api.realtime.conversation import Conversation, Item, item_from_client
from mstar_core.api.realtime.limits import RealtimeLimits
from mstar_core.api.realtime.protocol import ClientTooSlow, EventError, decode_pcm16, event, new_id
from mstar_core.api.realtime.response import ResponseRun
from mstar_core.api.realtime.vad import RATE, TurnDetector, VadEvent

log = logging.getLogger("mstar.api.realtime")


@attrs.define
class Outgoing:
    payload: dict[str, Any]
    response: ResponseRun | None = None
    audio_samples: int = 0
    droppable: bool = False
    size: int = 0  # bytes of its JSON, counted against max_queued_bytes while it waits


@attrs.define
class Speculation:
    """A turn started at a pause in the user's speech (preemptive generation): its reply runs held, and is kept at
    the stop only when the stop commits the same audio to the same conversation under the same settings."""

    run: ResponseRun
    item: Item  # the user's turn as it would be committed (its audio: the same samples a stop at the pause takes)
    start: int  # stream samples of the turn's audio
    end: int
    config: Any  # the session's settings it was started under,
    before: list[Item]  # the conversation's items before the turn,
    last: ResponseRun | None  # and the last response (the next prompt splices its ids in)


#: A closing session whose conversation held this much (decoded media, audio) has malloc hand it back.
TRIM_AFTER_BYTES = 16 << 20


class RealtimeSession:
    """State and event handlers; the route runs its receive loop and `sender`."""

    def __init__(self, state: Any, bridge: ModelBridge, limits: RealtimeLimits,
                 send: Callable[[dict[str, Any]], Awaitable[None]], *, detector: bool = True):
        """`detector=False` leaves the turn detector to `make_detector` (the route makes it off the loop)."""
        self.state, self.bridge, self.limits, self._send = state, bridge, limits, send
        self.id, self.conversation_id = new_id("sess"), new_id("conv")
        self.config = cfg.SessionConfig(bridge.model, output_modalities=bridge.default_modalities,
                                        voice=bridge.voices[0] if bridge.voices else None)
        self.conversation = Conversation(limits.max_items, limits.max_history_audio_seconds,
                                         limits.max_history_bytes)
        self.buffer = np.zeros(0, dtype=np.int16)
        self.buffer_start = 0  # stream sample index of buffer[0]
        self.stream_samples = 0  # samples appended in this session
        self.vad: TurnDetector | None = None
        self.speech_item: str | None = None  # the id the item of the speech in progress will get
        self.speech_start = 0  # stream sample where it began
        self.response: ResponseRun | None = None
        self.voice_locked = False
        self.queue: asyncio.Queue[Outgoing] = asyncio.Queue(maxsize=limits.send_queue)
        self.queued_bytes = 0  # JSON bytes of the events queued or being written
        self._sent = asyncio.Event()  # set each time the sender has written an event
        self.tasks: set[asyncio.Task] = set()
        self.responses_done = 0
        self.last_response: ResponseRun | None = None
        self.stopped = asyncio.Event()  # set when the client stopped reading
        #: start a turn's reply after this much silence, before the VAD's stop (a voice agent's; None: at the stop)
        self.preemptive_ms = limits.preemptive_after_ms if getattr(bridge, "kind", None) == "agent" else None
        self.speculation: Speculation | None = None
        self._vad_events = 0  # VAD events seen so far: a speculation started before one came is stale
        if detector:
            self._reset_vad()

    async def make_detector(self) -> None:
        """The session's turn detector, made in the off-loop pool: it copies the VAD model (tens of ms)."""
        await asyncio.to_thread(self._reset_vad)

    # -- sending ------------------------------------------------------------------------------------------

    async def emit(self, payload: dict[str, Any], *, response: ResponseRun | None = None, audio_samples: int = 0,
                   droppable: bool = False) -> None:
        """Queue a server event; waits while the queue is full in events or bytes (back-pressure; one event larger
        than the byte bound goes alone), gives up after send_timeout."""
        size = len(json_bytes(payload))
        try:
            async with asyncio.timeout(self.limits.send_timeout):
                while self.queue.full() or (self.queued_bytes and
                                            self.queued_bytes + size > self.limits.max_queued_bytes):
                    if self.stopped.is_set():  # the sender gave up on the socket: no use waiting out our own time
                        raise TimeoutError
                    self._sent.clear()
                    await self._sent.wait()
                self.queue.put_nowait(Outgoing(payload, response, audio_samples, droppable, size))
        except TimeoutError:
            self.stopped.set()
            raise ClientTooSlow(f"the client read no events for {self.limits.send_timeout:g} s") from None
        self.queued_bytes += size

    async def sender(self) -> None:
        """Write queued events to the socket in order; audio of a cancelled response is dropped unsent. One write
        that the socket has not taken within send_timeout (a client that reads nothing: the kernel's buffers are
        full) ends the session: ClientTooSlow, whatever the queue holds."""
        while True:
            out = await self.queue.get()
            resp = out.response
            try:
                if out.droppable and resp is not None and resp.status == "cancelled":
                    continue
                try:
                    await asyncio.wait_for(self._send(out.payload), self.limits.send_timeout)
                except TimeoutError:
                    self.stopped.set()
                    raise ClientTooSlow(f"the client read no events for {self.limits.send_timeout:g} s") from None
            finally:
                self.queued_bytes -= out.size
                self._sent.set()
            if out.audio_samples and resp is not None:
                resp.sent_samples += out.audio_samples

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def session_json(self) -> dict[str, Any]:
        return self.config.to_json(self.id)

    async def start(self) -> None:
        await self.emit(event("session.created", session=self.session_json()))

    async def close(self) -> None:
        """Free everything: the response in flight is cancelled (its pages freed), tasks stop."""
        self._drop_speculation()
        if self.response is not None and self.response.status == "in_progress":
            self.response.status = "cancelled"
            if self.response.handle is not None:
                self.response.handle.cancel()
            if self.response.task is not None:
                self.response.task.cancel()
        for task in list(self.tasks):
            task.cancel()
        self.buffer = np.zeros(0, dtype=np.int16)
        held = self.conversation.nbytes
        self.conversation.items.clear()
        if held >= TRIM_AFTER_BYTES:  # decoded media freed at once: back to the kernel, not kept by malloc
            asyncio.get_running_loop().run_in_executor(None, release_freed_memory)

    # -- dispatch -----------------------------------------------------------------------------------------

    async def handle(self, ev: Mapping[str, Any]) -> None:
        kind = ev.get("type")
        handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
        if handler is None:
            raise EventError(f"unknown event type {kind!r}; this server takes: {', '.join(sorted(_HANDLERS))}",
                             param="type", code="unknown_event")
        await handler(self, ev)

    # -- session.update -----------------------------------------------------------------------------------

    async def on_session_update(self, ev: Mapping[str, Any]) -> None:
        if "session" not in ev:
            raise EventError("'session' is required", param="session")
        # tools' schemas are checked (up to 128 of 64 KB): off the loop
        self.config = await asyncio.to_thread(cfg.update_session, self.config, ev["session"],
                                              speaks=self.bridge.speaks, voices=self.bridge.voices,
                                              voice_locked=self.voice_locked)
        self._drop_speculation()  # (a reply started under the old settings is not this session's any more)
        await self.make_detector()
        await self.emit(event("session.updated", session=self.session_json()))

    def _reset_vad(self) -> None:
        td = self.config.turn_detection
        if td is None:
            self.vad = None
            return
        old = self.vad
        if old is not None and (old.threshold, old.silence_duration_ms, old.prefix_padding_ms) == (
                td.threshold, td.silence_duration_ms, td.prefix_padding_ms):
            return
        self.vad = TurnDetector(td.threshold, td.silence_duration_ms, td.prefix_padding_ms,
                                pause_ms=self.preemptive_ms)
        self.vad.reset(self.stream_samples)

    # -- input audio buffer -------------------------------------------------------------------------------

    async def on_append(self, ev: Mapping[str, Any]) -> None:
        max_bytes = int(self.limits.max_buffer_seconds * RATE * 2)
        audio = ev.get("audio")
        # megabytes of base64 (minutes of audio) are decoded in the off-loop pool, piece by piece
        pcm = (await asyncio.to_thread(decode_pcm16, audio, "audio", self.limits.max_event_bytes)
               if isinstance(audio, str) and len(audio) >= LARGE_BYTES
               else decode_pcm16(audio, "audio", self.limits.max_event_bytes))
        if (self.buffer.size + pcm.size) > self.limits.max_buffer_seconds * RATE:
            raise EventError(f"the input audio buffer would hold more than {self.limits.max_buffer_seconds:g} s "
                             f"({max_bytes} bytes); commit or clear it first", param="audio",
                             code="input_audio_buffer_full")
        self.buffer = np.concatenate([self.buffer, pcm])
        self.stream_samples += pcm.size
        if self.vad is not None:
            # the detector scores every 32 ms frame (minutes of audio in one append: seconds): off the loop. The
            # session's events are handled one at a time, so nothing else touches the detector meanwhile.
            vad_events = self.vad.feed(pcm) if pcm.size <= RATE else await asyncio.to_thread(self.vad.feed, pcm)
            for vad_event in vad_events:
                await self._on_vad(vad_event)

    async def _on_vad(self, vad_event: VadEvent) -> None:
        td = self.config.turn_detection
        self._vad_events += 1
        if vad_event.kind == "paused":
            await self._speculate(vad_event.ms)
            return
        if vad_event.kind == "resumed":
            self._drop_speculation()
            return
        if vad_event.kind == "started":
            self._drop_speculation()
            self.speech_item = new_id("item")
            self.speech_start = vad_event.ms * RATE // 1000
            await self.emit(event("input_audio_buffer.speech_started", audio_start_ms=vad_event.ms,
                                  item_id=self.speech_item))
            if td is not None and td.interrupt_response and self.response is not None:
                await self.barge_in()
            return
        item_id = self.speech_item or new_id("item")
        self.speech_item = None
        spec, self.speculation = self.speculation, None
        await self.emit(event("input_audio_buffer.speech_stopped", audio_end_ms=vad_event.ms, item_id=item_id))
        started, end = self._turn_span(vad_event.ms)
        segment = self.buffer[started - self.buffer_start : max(0, end - self.buffer_start)]
        self.buffer = self.buffer[max(0, end - self.buffer_start):]
        self.buffer_start = max(self.buffer_start, end)
        keep = spec is not None and (spec.start, spec.end, spec.item.id) == (started, end, item_id) and \
            spec.config is self.config and spec.last is self.last_response and _same(spec.before,
                                                                                     self.conversation.items)
        if segment.size < RATE // 10:
            if spec is not None:
                spec.run.discard()
            return  # a click, not a turn
        await self._commit(segment, item_id, spec.item if keep else None)
        wanted = td is not None and td.create_response and self.response is None
        if spec is not None and keep and wanted and _same(spec.run.items, self.conversation.items):
            self.response = spec.run  # the reply started at the pause: what it made so far goes out now
            await spec.run.release()
            return
        if spec is not None:
            spec.run.discard()
        if wanted:
            await self.start_response(None)

    def _turn_span(self, end_ms: int) -> tuple[int, int]:
        """Stream samples of the turn that ends (its last speech) at `end_ms`: from its start less the padding."""
        td = self.config.turn_detection
        started = max(self.buffer_start, self.speech_start - (td.prefix_padding_ms if td else 0) * RATE // 1000)
        return started, end_ms * RATE // 1000

    async def _speculate(self, end_ms: int) -> None:
        """The user paused: start the reply to the turn as a stop now would commit it, held (see `Speculation`)."""
        td = self.config.turn_detection
        self._drop_speculation()
        if td is None or not td.create_response or self.response is not None or self.speech_item is None \
                or not self.bridge.takes_audio:
            return
        started, end = self._turn_span(end_ms)
        segment = self.buffer[started - self.buffer_start : max(0, end - self.buffer_start)]
        if segment.size < RATE // 10:
            return
        item = Item(self.speech_item, "message", role="user", content_type="input_audio", audio=segment.copy())
        before, config, last, seen = list(self.conversation.items), self.config, self.last_response, self._vad_events
        options = await asyncio.to_thread(cfg.response_options, config, None, speaks=self.bridge.speaks,
                                          voices=self.bridge.voices)
        if seen != self._vad_events or self.config is not config or self.response is not None:
            return  # the speech went on (or the session changed) while its options were made
        run = ResponseRun(self, options, [*before, item], held=True)
        self.speculation = Speculation(run, item, started, end, config, before, last)
        run.start()

    def _drop_speculation(self) -> None:
        spec, self.speculation = self.speculation, None
        if spec is not None:
            spec.run.discard()

    async def barge_in(self) -> None:
        """Speech while the model speaks: cancel the response now and cut its item at the audio sent."""
        run = self.response
        if run is None or run.status != "in_progress":
            return
        run.cancel("turn_detected")
        item = run.message
        if item is not None and run.audio:
            sent = run.sent_samples
            item.truncate_audio(sent)
            await self.emit(event("conversation.item.truncated", item_id=item.id, content_index=0,
                                  audio_end_ms=sent * 1000 // RATE))

    async def on_commit(self, ev: Mapping[str, Any]) -> None:
        self._drop_speculation()
        if self.buffer.size < RATE // 10:
            raise EventError(f"buffer too small: the input audio buffer holds {self.buffer.size * 1000 // RATE} ms; "
                             "commit at least 100 ms of audio", code="input_audio_buffer_commit_empty")
        segment, self.buffer = self.buffer, np.zeros(0, dtype=np.int16)
        self.buffer_start = self.stream_samples
        if self.vad is not None:
            self.vad.reset(self.stream_samples)
        await self._commit(segment, self.speech_item or new_id("item"))
        self.speech_item = None

    async def _commit(self, segment: np.ndarray, item_id: str, item: Item | None = None) -> None:
        """Add the user's audio turn (`item`: the one a speculation made of the same samples) to the conversation."""
        if not self.bridge.takes_audio:
            await self.emit(event("input_audio_buffer.committed", item_id=item_id,
                                  previous_item_id=self.conversation.last_id))
            raise EventError(f"model '{self.bridge.model}' does not take audio input; send text items "
                             "(conversation.item.create with input_text)", code="audio_not_supported")
        if item is None:
            item = Item(item_id, "message", role="user", content_type="input_audio", audio=segment.copy())
        previous = self.conversation.add(item)
        await self.emit(event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous))
        await self.emit(event("conversation.item.added", previous_item_id=previous, item=item.to_json()))
        await self.emit(event("conversation.item.done", previous_item_id=previous, item=item.to_json()))

    async def on_clear(self, ev: Mapping[str, Any]) -> None:
        self._drop_speculation()
        self.buffer = np.zeros(0, dtype=np.int16)
        self.buffer_start = self.stream_samples
        if self.vad is not None:
            self.vad.reset(self.stream_samples)
        await self.emit(event("input_audio_buffer.cleared"))

    # -- conversation items -------------------------------------------------------------------------------

    async def on_item_create(self, ev: Mapping[str, Any]) -> None:
        # images and video decode (seconds for a large one): off the loop
        item = await asyncio.to_thread(item_from_client, ev.get("item"), "item", self.limits.max_event_bytes,
                                       takes_visual=self.bridge.takes_visual)
        previous = self.conversation.add(item, ev.get("previous_item_id"))
        await self.emit(event("conversation.item.added", previous_item_id=previous, item=item.to_json()))
        await self.emit(event("conversation.item.done", previous_item_id=previous, item=item.to_json()))

    async def on_item_delete(self, ev: Mapping[str, Any]) -> None:
        self.conversation.delete(ev.get("item_id"))
        await self.emit(event("conversation.item.deleted", item_id=ev["item_id"]))

    async def on_item_retrieve(self, ev: Mapping[str, Any]) -> None:
        item = self.conversation.find(ev.get("item_id"))
        await self.emit(event("conversation.item.retrieved", item=item.to_json()))

    async def on_item_truncate(self, ev: Mapping[str, Any]) -> None:
        item = self.conversation.find(ev.get("item_id"))
        ms, index = ev.get("audio_end_ms"), ev.get("content_index", 0)
        if item.role != "assistant" or item.content_type != "output_audio":
            raise EventError("only an assistant audio message can be truncated", param="item_id",
                             code="invalid_item")
        if isinstance(ms, bool) or not isinstance(ms, int) or ms < 0:
            raise EventError("'audio_end_ms' must be a non-negative integer", param="audio_end_ms")
        if index != 0:
            raise EventError("'content_index' must be 0 (an assistant audio message has one part)",
                             param="content_index")
        heard = item.marks[-1][0] if item.marks else 0
        if ms * RATE // 1000 > heard:
            raise EventError(f"'audio_end_ms' is {ms}; the item has {heard * 1000 // RATE} ms of audio",
                             param="audio_end_ms")
        item.truncate_audio(ms * RATE // 1000)
        await self.emit(event("conversation.item.truncated", item_id=item.id, content_index=0, audio_end_ms=ms))

    # -- responses ----------------------------------------------------------------------------------------

    async def on_response_create(self, ev: Mapping[str, Any]) -> None:
        await self.start_response(ev.get("response"))

    async def start_response(self, data: Any) -> None:
        if self.response is not None:
            raise EventError(f"the conversation already has an active response ({self.response.id}); cancel it or "
                             "wait for response.done", code="conversation_already_has_active_response")
        options = await asyncio.to_thread(cfg.response_options, self.config, data, speaks=self.bridge.speaks,
                                          voices=self.bridge.voices)
        items = self.conversation.items
        if options.input is not None:
            items = await asyncio.to_thread(lambda: [item_from_client(i, f"response.input[{n}]",
                                                                      self.limits.max_event_bytes,
                                                                      takes_visual=self.bridge.takes_visual)
                                                     for n, i in enumerate(options.input)])
        run = ResponseRun(self, options, items)
        self.response = run
        run.start()

    async def on_response_cancel(self, ev: Mapping[str, Any]) -> None:
        run = self.response
        wanted = ev.get("response_id")
        if run is None or (wanted is not None and wanted != run.id):
            raise EventError("there is no active response to cancel" if run is None else
                             f"'response_id' {wanted!r} is not the active response ({run.id})",
                             param="response_id", code="response_cancel_not_active")
        run.cancel("client_cancelled")

    def previous_reply(self, items: list[Item]) -> tuple[list[int], Item] | None:
        """The last response's prompt ids and reply item (its ids as generated, or as truncated), if still in `items`."""
        last = self.last_response
        if last is None or last.prompt_ids is None or last.message is None or last.status == "failed":
            return None
        return (last.prompt_ids, last.message) if last.message in items else None

    def on_response_done(self, run: ResponseRun) -> None:
        if self.response is run:
            self.response = None
        self.responses_done += 1
        if run.samples:
            self.voice_locked = True
        self.last_response = run


def _same(items: list[Item], now: list[Item]) -> bool:
    return len(items) == len(now) and all(a is b for a, b in zip(items, now, strict=True))


_HANDLERS: dict[str, Callable[[RealtimeSession, Mapping[str, Any]], Awaitable[None]]] = {
    "session.update": RealtimeSession.on_session_update,
    "input_audio_buffer.append": RealtimeSession.on_append,
    "input_audio_buffer.commit": RealtimeSession.on_commit,
    "input_audio_buffer.clear": RealtimeSession.on_clear,
    "conversation.item.create": RealtimeSession.on_item_create,
    "conversation.item.delete": RealtimeSession.on_item_delete,
    "conversation.item.retrieve": RealtimeSession.on_item_retrieve,
    "conversation.item.truncate": RealtimeSession.on_item_truncate,
    "response.create": RealtimeSession.on_response_create,
    "response.cancel": RealtimeSession.on_response_cancel,
}
