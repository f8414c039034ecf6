"""One response of a realtime session: the model's request, its outputs as server events, its end.

A response streams the reply's text (`response.output_text.delta`, or the spoken reply's transcript) as the
model writes it, its audio (`response.output_audio.delta`, pcm16 24 kHz) as the model speaks it, and each
Qwen-format `<tool_call>` as a function-call item whose arguments stream (`function_call_arguments.delta`).
`cancel(reason)` ends it at once: the request is cancelled (its pages freed), every open part and item is
closed and `response.done` goes out with status `cancelled`; audio not yet written to the socket is dropped.

A held response (`held=True`: a turn started preemptively, at a pause in the user's speech) runs the same way
but keeps what it would send, and what it would change in the conversation, until `release()` (the turn was
committed as it was started: all of it goes out in order, then the rest as it comes) or `discard()` (the user
spoke on: the request is cancelled, its pages freed, nothing of it was ever seen).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mstar_core.api.http.errors import ApiError
from mstar_core.api.realtime.config import PCM, ResponseOptions
from mstar_core.api.realtime.conversation import Item
from mstar_core.api.realtime.protocol import ClientTooSlow, EventError, encode_pcm16, event, new_id
from mstar_core.api.requests.submit import submit
from mstar_core.api.requests.text import TextAssembler
from mstar_core.errors import RequestError

log = logging.getLogger("mstar.api.realtime")


class ResponseRun:
    """A response in flight; `session` provides `emit`, `bridge`, `conversation` and `on_response_done`."""

    def __init__(self, session: Any, options: ResponseOptions, items: Sequence[Item], *, held: bool = False):
        self.session, self.options, self.items = session, options, list(items)
        #: while held: what the response would do to the session (send an event, add an item), in order
        self._held: list[Callable[[], Awaitable[None]]] | None = [] if held else None
        self.id = new_id("resp")
        self.audio = options.output_modalities == ("audio",)
        self.in_conversation = options.conversation == "auto"
        self.status = "in_progress"
        self.details: dict[str, Any] | None = None
        self.output: list[Item] = []
        self.message: Item | None = None
        self.call: Item | None = None
        self.handle: Any = None
        self.task: asyncio.Task | None = None
        self.samples = 0  # audio samples produced
        self.sent_samples = 0  # of those, written to the socket
        self.input_tokens = 0
        self.prompt_ids: list[int] | None = None
        self.audio_frames = 0
        self.assembler: TextAssembler | None = None
        self.tools = session.bridge.tool_calls(options)  # chat's parser, in the model's tool format
        self.first_audio_at: float | None = None
        self.ended = asyncio.Event()
        #: a voice agent's reply: where in the message's text the piece the TTS speaks now ends
        self.spoken_chars: int | None = None

    # -- wire forms ---------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        generated = self.assembler.generated if self.assembler else 0
        usage = None
        if self.status != "in_progress":
            usage = {"total_tokens": self.input_tokens + generated + self.audio_frames,
                     "input_tokens": self.input_tokens, "output_tokens": generated + self.audio_frames,
                     "input_token_details": {"text_tokens": self.input_tokens, "audio_tokens": 0, "cached_tokens": 0},
                     "output_token_details": {"text_tokens": generated, "audio_tokens": self.audio_frames}}
        return {"object": "realtime.response", "id": self.id, "status": self.status, "status_details": self.details,
                "output": [i.to_json() for i in self.output], "conversation_id":
                self.session.conversation_id if self.in_conversation else None,
                "output_modalities": list(self.options.output_modalities),
                "max_output_tokens": self.options.max_output_tokens or "inf",
                "audio": {"output": {"format": dict(PCM), "voice": self.options.voice}}, "usage": usage,
                "metadata": self.options.metadata}

    async def _emit(self, kind: str, *, audio_samples: int = 0, droppable: bool = False, **fields: Any) -> None:
        payload = event(kind, **fields)
        await self._effect(lambda: self.session.emit(payload, response=self, audio_samples=audio_samples,
                                                     droppable=droppable))

    async def _effect(self, act: Callable[[], Awaitable[None]]) -> None:
        """Do `act` (something the session sees) now, or keep it for `release()` while held."""
        if self._held is not None:
            self._held.append(act)
        else:
            await act()

    @property
    def held(self) -> bool:
        return self._held is not None

    async def release(self) -> None:
        """Do what the held response kept, in order; what it does meanwhile queues behind (held until the end)."""
        while self._held:
            await self._held.pop(0)()
        self._held = None

    def discard(self) -> None:
        """Drop a held response unseen: its request is cancelled (pages freed), what it kept is forgotten."""
        self._held = []
        self.status = "cancelled"
        if self.handle is not None:
            self.handle.cancel()
        if self.task is not None:
            self.task.cancel()

    def _where(self, item: Item) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": item.id, "output_index": self.output.index(item)}

    async def _add_item(self, item: Item) -> None:
        self.output.append(item)
        await self._emit("response.output_item.added", response_id=self.id, output_index=len(self.output) - 1,
                         item=item.to_json())
        if self.in_conversation:
            async def add() -> None:
                previous = self.session.conversation.add(item)
                await self.session.emit(event("conversation.item.added", previous_item_id=previous,
                                              item=item.to_json()), response=self)

            await self._effect(add)

    async def _done_item(self, item: Item) -> None:
        if item.status == "in_progress":
            item.status = "completed" if self.status in ("in_progress", "completed") else "incomplete"
        await self._emit("response.output_item.done", response_id=self.id, output_index=self.output.index(item),
                         item=item.to_json())
        if self.in_conversation:
            await self._emit("conversation.item.done", item=item.to_json())

    # -- the message item ---------------------------------------------------------------------------------

    async def _message(self) -> Item:
        if self.message is None:
            kind = "output_audio" if self.audio else "output_text"
            self.message = Item(new_id("item"), "message", role="assistant", status="in_progress", content_type=kind,
                                ids=[])
            await self._add_item(self.message)
            part = {"type": "audio", "transcript": ""} if self.audio else {"type": "text", "text": ""}
            await self._emit("response.content_part.added", **self._where(self.message), content_index=0, part=part)
        return self.message

    async def _text(self, piece: str) -> None:
        if not piece:
            return
        item = await self._message()
        item.text += piece
        kind = "response.output_audio_transcript.delta" if self.audio else "response.output_text.delta"
        await self._emit(kind, **self._where(item), content_index=0, delta=piece)

    async def _close_message(self) -> None:
        item = self.message
        if item is None:
            return
        where = {**self._where(item), "content_index": 0}
        if self.audio:
            await self._emit("response.output_audio.done", **where)
            await self._emit("response.output_audio_transcript.done", **where, transcript=item.text)
            part = {"type": "audio", "transcript": item.text}
        else:
            await self._emit("response.output_text.done", **where, text=item.text)
            part = {"type": "text", "text": item.text}
        await self._emit("response.content_part.done", **where, part=part)
        await self._done_item(item)

    # -- tool calls ---------------------------------------------------------------------------------------

    async def _reply_text(self, piece: str) -> None:
        if self.tools is None:
            await self._text(piece)
            return
        for ev in self.tools.feed(piece):
            await self._tool_event(ev)

    async def _tool_event(self, ev: tuple) -> None:
        """One event of chat's `ToolCalls`: text, a call's start, a piece of its arguments, its end."""
        if ev[0] == "text":
            await self._text(ev[1])
        elif ev[0] == "start":
            self.call = Item(new_id("item"), "function_call", status="in_progress", name=ev[3], call_id=ev[2])
            await self._add_item(self.call)
        elif ev[0] == "arguments" and self.call is not None and ev[2]:
            self.call.arguments += ev[2]
            await self._emit("response.function_call_arguments.delta", **self._where(self.call),
                             call_id=self.call.call_id, delta=ev[2])
        elif ev[0] == "end" and self.call is not None:
            call, self.call = self.call, None
            call.status = "completed" if ev[2] else "incomplete"
            await self._emit("response.function_call_arguments.done", **self._where(call), call_id=call.call_id,
                             name=call.name, arguments=call.arguments)
            await self._done_item(call)

    # -- running ------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        bridge = self.session.bridge
        try:
            await self._emit("response.created", response=self.to_json())
            inputs = await bridge.inputs(self.items, self.options, self.session.previous_reply(self.items))
            self.handle = await submit(self.session.state, bridge.model, inputs)
            self.prompt_ids = bridge.prompt_ids(self.handle.prepared)
            self.input_tokens = bridge.prompt_tokens(self.handle.prepared)
            adapter = bridge.adapter
            self.assembler = TextAssembler(adapter, (), self.options.max_output_tokens)
            if bridge.kind == "speech":
                await self._text(self.items and next((i.text for i in reversed(self.items)
                                                      if i.role == "user" and i.text), "") or "")
            async for out in self.handle:
                if out.name == bridge.audio_output and self.audio:
                    await self._audio(bridge.pcm(out.value))
                elif bridge.agent is not None and out.name in (bridge.agent["transcript"], bridge.agent["prompt_ids"],
                                                               bridge.agent["spoken_text"]):
                    await self._agent_output(out.name, out.value)
                elif out.name == "codes" and out.value is not None:
                    self.audio_frames += 1
                elif out.name == bridge.token_output and bridge.kind in ("chat", "agent"):
                    await self._reply_text(self.assembler.feed(int(out.value)))
                    if self.message is not None and self.message.ids is not None:
                        self.message.ids = list(self.assembler.ids)
                    if self.assembler.finish_reason is not None and not self.audio:
                        break  # text over (EOS, or max tokens): nothing else is wanted
            env = await self.handle.result() if self.assembler.finish_reason is None else {}
            if bridge.kind in ("chat", "agent"):
                await self._reply_text(self.assembler.close(env))
            if self.tools is not None:
                for ev in self.tools.finish():
                    await self._tool_event(ev)
            if self.message is not None and self.message.ids is not None:
                self.message.ids = list(self.assembler.ids)
            length = bridge.kind in ("chat", "agent") and self.assembler.finish_reason == "length"
            await self.finish("incomplete" if length else "completed", "max_output_tokens" if length else None)
        except (asyncio.CancelledError, ClientTooSlow):
            raise
        except (EventError, ApiError, RequestError) as exc:
            error = {"type": "invalid_request_error", "code": getattr(exc, "code", None) or "invalid_request",
                     "message": getattr(exc, "message", None) or str(exc)}
            await self.finish("failed", None, error)
        except Exception as exc:  # the model's request failed: this response fails, the session goes on
            log.warning("realtime response failed: %s: %s", type(exc).__name__, exc)
            await self.finish("failed", None, {"type": "server_error", "code": "response_failed",
                                               "message": f"{type(exc).__name__}: {exc}"})
        finally:
            if self.handle is not None:
                self.handle.cancel()

    async def _agent_output(self, name: str, value: Any) -> None:
        """A voice agent's own outputs: the turn's transcript (the user item's, as the event OpenAI sends when
        input transcription runs), the prompt it wrote (its ids: the next turn's KV reuse), the piece spoken now."""
        outputs = self.session.bridge.agent
        if name == outputs["transcript"]:
            item = next((i for i in reversed(self.items) if i.type == "message" and i.role == "user"
                         and i.audio is not None and not i.text), None)
            if item is not None:
                async def transcribed() -> None:
                    item.text = str(value)
                    await self.session.emit(event("conversation.item.input_audio_transcription.completed",
                                                  item_id=item.id, content_index=0, transcript=item.text),
                                            response=self)

                await self._effect(transcribed)
        elif name == outputs["prompt_ids"]:
            self.prompt_ids = [int(t) for t in value]
            self.input_tokens = len(self.prompt_ids)
        elif name == outputs["spoken_text"] and self.message is not None:
            start = self.spoken_chars or 0
            at = self.message.text.find(str(value), start)
            self.spoken_chars = at + len(str(value)) if at >= 0 else len(self.message.text)

    async def _audio(self, pcm: Any) -> None:
        if not pcm.size:
            return
        item = await self._message()
        if self.first_audio_at is None:
            import time

            self.first_audio_at = time.perf_counter()
        self.samples += pcm.size
        chars, ids = len(item.text), len(item.ids or ())
        if self.spoken_chars is not None and item.ids:  # a TTS behind the text: what is heard ends with its piece
            chars = min(chars, self.spoken_chars)
            detokenize = self.session.bridge.adapter.detokenize
            ids = next((k for k in range(1, len(item.ids) + 1) if len(detokenize(item.ids[:k])) >= chars), ids)
        item.marks.append((self.samples, chars, ids))
        await self._emit("response.output_audio.delta", **self._where(item), content_index=0,
                         delta=encode_pcm16(pcm), audio_samples=pcm.size, droppable=True)

    def cancel(self, reason: str) -> None:
        """End now: the request is cancelled and `response.done` (cancelled) is queued before this returns."""
        if self.status != "in_progress":
            return
        self.status = "cancelled"  # (set first: the task's own unwinding must not finish it again)
        if self.handle is not None:
            self.handle.cancel()
        if self.task is not None:
            self.task.cancel()
        self.session.spawn(self.finish("cancelled", reason, force=True))

    async def finish(self, status: str, reason: str | None, error: dict[str, Any] | None = None, *,
                     force: bool = False) -> None:
        if self.ended.is_set() or (self.status != "in_progress" and not force):
            return
        if not self.output and status in ("completed", "incomplete"):
            await self._message()  # an empty reply is still an (empty) assistant message, as OpenAI gives it
        self.ended.set()
        self.status = status
        self.details = {"type": status, "reason": reason, "error": error} if status != "completed" else None
        if self.call is not None:
            self.call.status = "incomplete"
            await self._emit("response.function_call_arguments.done", **self._where(self.call),
                             call_id=self.call.call_id, name=self.call.name, arguments=self.call.arguments)
            await self._done_item(self.call)
            self.call = None
        await self._close_message()
        await self._emit("response.done", response=self.to_json())

        async def done() -> None:
            self.session.on_response_done(self)

        await self._effect(done)
