"""Page tables: reserve pages for a sequence's next tokens (copy-on-write), prefix-cache matching, fork, free."""

from __future__ import annotations

from hashlib import blake2b
from typing import TYPE_CHECKING

import attrs
import torch

from mstar_kvcache.pool import PagePool
from mstar_kvcache.sequence import Sequence

if TYPE_CHECKING:
    from mstar_kvcache.offload import HostTier

#: Bytes of a page key (blake2b digest): collisions are as unlikely as for any cryptographic hash, so one
#: request's pages are never handed to another whose content differs (a crafted `hash()` collision could).
DIGEST_SIZE = 16


def _tensor_bytes(value: torch.Tensor) -> bytes:
    value = value.detach()
    if value.device.type != "cpu":
        value = value.cpu()
    if value.dtype == torch.bfloat16:  # numpy has no bfloat16: hash its raw 16-bit words
        value = value.view(torch.int16)
    return str((value.dtype, tuple(value.shape))).encode() + value.contiguous().numpy().tobytes()


def page_content(seq: Sequence, lo: int, hi: int) -> bytes:
    """Everything besides the ids that shapes the keys of tokens `lo..hi-1`: embeddings, positions, routing, tensors."""
    parts: list[bytes] = []
    for start, rows in seq.embeds:
        a, b = max(lo, start), min(hi, start + rows.shape[0])
        if a < b:
            parts.append(b"e%d" % a + _tensor_bytes(rows[a - start : b - start]))
    if seq.positions is not None:
        parts.append(b"p" + _tensor_bytes(seq.positions[:, lo:hi]))
    if seq.routing is not None:
        parts.append(b"r" + _tensor_bytes(torch.tensor(seq.routing[lo:hi])))
    for start, end, name, value, per_token in seq.extras:
        a, b = max(lo, start), min(hi, end)
        if a < b:
            part = value[a - start : b - start] if per_token else value
            parts.append(b"x%d:%d:" % (a, start) + name.encode() + b"=" + _tensor_bytes(part))
    if seq.lora is not None:  # keys computed under a LoRA adapter (its load, not only its name)
        parts.append(b"l" + seq.lora.encode())
    return b"".join(parts)


def chain_digest(previous: bytes, tokens: list[int], content: bytes = b"") -> bytes:
    """Key of a full page: the previous page's key, its token ids and any other content (equal keys, equal prefixes)."""
    h = blake2b(previous, digest_size=DIGEST_SIZE)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
    if content:
        h.update(len(content).to_bytes(8, "little"))
        h.update(content)
    return h.digest()


class BlockManager:
    """Moves pages between the pool and sequences; knows nothing about models or scheduling."""

    def __init__(self, pool: PagePool, prefix_caching: bool = True, salt: str = "", host: HostTier | None = None):
        self.pool = pool
        self.host = host  # the host tier (setting kv_offload): preempted sequences and evicted prefix pages go there
        self.page_size = pool.page_size
        self.prefix_caching = prefix_caching
        # the chain starts from the node's name: nodes sharing a pool never hit each other's pages
        self.root = blake2b(salt.encode(), digest_size=DIGEST_SIZE).digest()

    def _key(self, seq: Sequence, i: int, previous: bytes, length: int | None = None) -> bytes:
        """Page `i`'s key after `previous`: of the whole page, or of its first `length` tokens (a partial page's
        key differs from every full page's, since the digest counts the tokens)."""
        lo = i * self.page_size
        hi = lo + (self.page_size if length is None else length)
        plain = (seq.positions is None and seq.routing is None and not seq.embeds and not seq.extras
                 and seq.lora is None)
        return chain_digest(previous, seq.tokens[lo:hi], b"" if plain else page_content(seq, lo, hi))

    def pages_needed(self, seq: Sequence, n: int) -> int:
        """Pages `reserve(seq, n)` would take from the pool (new pages plus a copy of a shared partial page)."""
        end = seq.num_computed + n
        need = -(-end // self.page_size) - len(seq.pages)
        if n and self._shared_tail(seq):
            need += 1
        return need

    def _shared_tail(self, seq: Sequence) -> bool:
        """Whether the page the next token goes into is partly written and read by another sequence too."""
        offset = seq.num_computed % self.page_size
        # (a planned restore holds fewer pages than its tokens: its tail page is not allocated yet)
        return bool(offset) and len(seq.pages) * self.page_size > seq.num_computed \
            and self.pool.refcount[seq.pages[-1]] > 1

    def total_pages(self, seq: Sequence) -> int:
        """Pages the whole sequence needs once every appended token is cached."""
        return -(-len(seq.tokens) // self.page_size)

    def reserve(self, seq: Sequence, n: int) -> bool:
        """Give `seq` room to write its next `n` tokens; False (and no change) if the pool is short."""
        if self.pages_needed(seq, n) > self.pool.num_available:
            return False
        if n and self._shared_tail(seq):
            shared = seq.pages[-1]
            seq.pages[-1] = self.pool.copy(shared)  # another branch still reads the shared page
            self.pool.decref(shared)
        end = seq.num_computed + n
        while len(seq.pages) * self.page_size < end:
            seq.pages.append(self.pool.allocate())
        return True

    def match_prefix(self, seq: Sequence) -> int:
        """Reuse cached pages for a sequence that holds none; returns the number of tokens reused.

        At least one token is always left to compute, so the step still produces logits, and every token
        whose row the pending call returns (`rows_from` on) is computed. A sequence offloaded to the host tier
        takes back its computed length instead (its keys and values are copied back once it is admitted), and
        a page spilled there counts as cached.
        """
        if seq.host is not None and not seq.pages and not seq.num_computed:
            return self.host.plan_restore(seq)
        if not (self.prefix_caching and seq.cacheable) or seq.pages or seq.num_computed:
            return 0
        previous = self.root
        reusable = len(seq.tokens) - 1 if seq.rows_from is None else min(len(seq.tokens) - 1, seq.rows_from)
        for i in range(reusable // self.page_size):
            key = self._key(seq, i, previous)
            page = self.pool.lookup(key)
            if page is not None:
                self.pool.incref(page)
                self.pool.hits += 1
            elif self.host is None or (page := self.host.fetch(key)) is None:  # (a fetched page comes referenced)
                break
            seq.pages.append(page)
            seq.hashes.append(key)
            previous = key
        seq.num_computed = len(seq.pages) * self.page_size
        self._match_partial(seq, reusable - seq.num_computed, previous)
        return seq.num_computed

    def _match_partial(self, seq: Sequence, most: int, previous: bytes) -> None:
        """After the full pages matched: the longest partial page a finished sequence left (`keep_partial`) whose
        tokens start the next page, reused (a conversation's next turn then computes only its new tokens)."""
        i = len(seq.pages)
        for length in range(min(most, self.page_size - 1), 0, -1):
            page = self.pool.lookup(self._key(seq, i, previous, length))
            if page is None:
                continue
            self.pool.incref(page)  # (written in place past `length` while it is the only reader; else copied)
            self.pool.partial_hits += 1
            seq.pages.append(page)
            seq.num_computed += length
            return

    def keep_partial(self, seq: Sequence) -> None:
        """Key a finished sequence's last, partly written page by its tokens, for `match_prefix` to reuse."""
        length = seq.num_computed % self.page_size
        full = seq.num_computed // self.page_size
        if (not length or not (self.prefix_caching and seq.cacheable) or len(seq.pages) <= full
                or len(seq.hashes) < full or self.pool.refcount[seq.pages[full]] != 1):
            return  # (a page another sequence still holds may yet be written by it)
        previous = seq.hashes[full - 1] if full else self.root
        self.pool.register(seq.pages[full], self._key(seq, full, previous, length))

    def commit(self, seq: Sequence) -> None:
        """Key the pages that became full so later requests can reuse them."""
        if not (self.prefix_caching and seq.cacheable):  # keys serve only the prefix cache: skip the digests
            return
        full = seq.num_computed // self.page_size
        previous = seq.hashes[-1] if seq.hashes else self.root
        for i in range(len(seq.hashes), full):
            previous = self._key(seq, i, previous)
            seq.hashes.append(previous)
            self.pool.register(seq.pages[i], previous)

    def truncate(self, seq: Sequence, length: int) -> None:
        """Drop tokens from `length` on, releasing pages no longer needed."""
        if seq.host is not None:
            self.host.truncate(seq, length)
        del seq.tokens[length:]
        seq.token_ids = None  # (it mirrors the dropped tokens)
        seq.num_computed = min(seq.num_computed, length)
        keep = -(-seq.num_computed // self.page_size)
        if seq.num_computed % self.page_size and keep <= len(seq.pages):
            # the kept tail page will be written from inside: it must no longer stand for its old content in the
            # prefix cache (a page another sequence reads too is copied before that write, see `reserve`)
            if self.pool.refcount[seq.pages[keep - 1]] == 1:
                self.pool.unregister(seq.pages[keep - 1])
        for page in seq.pages[keep:]:
            self.pool.decref(page)
        del seq.pages[keep:]
        del seq.hashes[seq.num_computed // self.page_size :]
        if seq.limits is not None:
            del seq.limits[length:]
        seq.embeds = [(start, rows[: length - start]) for start, rows in seq.embeds if start < length]
        if seq.positions is not None:
            seq.positions = seq.positions[:, :length]
        if seq.routing is not None:
            del seq.routing[length:]
        seq.extras = [(a, min(b, length), name, value if not tok else value[: length - a], tok)
                      for a, b, name, value, tok in seq.extras if a < length]

    def preempt(self, seq: Sequence) -> None:
        """Free a preempted sequence's pages, first copying them to the host tier where it takes them."""
        if self.host is not None:
            self.host.save(seq)
        self.free(seq)

    def discard(self, seq: Sequence) -> None:
        """Free a sequence that is gone (released, cancelled, dropped): its pages and any host copy of them."""
        self.keep_partial(seq)
        self.free(seq)
        if self.host is not None:
            self.host.discard(seq)

    def free(self, seq: Sequence) -> None:
        """Release every page (tokens stay, so a preempted sequence can be recomputed)."""
        for page in seq.pages:
            self.pool.decref(page)
        seq.pages.clear()
        seq.hashes.clear()
        seq.num_computed = 0

    def fork(self, src: Sequence, label: str) -> Sequence:
        """A new label sharing every page of `src` (no copies until one of them writes into a shared page)."""
        for page in src.pages:
            self.pool.incref(page)
        return attrs.evolve(
            src,
            label=label,
            tokens=list(src.tokens),
            pages=list(src.pages),
            hashes=list(src.hashes),
            limits=None if src.limits is None else list(src.limits),
            embeds=list(src.embeds),
            routing=None if src.routing is None else list(src.routing),
            extras=list(src.extras),
            collected=[],
            recompute=False,
            host=None,  # a host copy has one owner: a fork of a preempted label recomputes
            generated=list(src.generated),
            generator=None,  # never shared: the engine gives the fork its own (sampling is not this file's job)
            pending=None,
            speculation=None,  # (the engine settles a label's verified tokens before forking it)
            token_ids=None,  # a mirror of `src.tokens`, which the fork's list no longer is once either grows
        )
