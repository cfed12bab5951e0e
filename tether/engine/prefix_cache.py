"""Find the cached sequence that shares the longest prefix with a new prompt.

Agentic rollouts re-send the whole conversation every turn, and conversations (and the samples of one
GRPO group) share their system prompt and tool list. The engine keeps the KV cache of finished turns
("parked") and of running requests' prompts, and this index finds the best one to start from, so only
the new suffix is prefilled (the idea of vLLM's automatic prefix caching, without paging).

Sequences are indexed by chained hashes of 16-token blocks (like vLLM's block hashes): walking a new
prompt's blocks narrows the candidates, and the last partial block is compared token by token.
"""

from __future__ import annotations

from typing import Any

BLOCK = 16


def _block_hashes(tokens: list[int]) -> list[int]:
    hashes, h = [], 0
    for j in range(len(tokens) // BLOCK):
        h = hash((h, tuple(tokens[j * BLOCK:(j + 1) * BLOCK])))
        hashes.append(h)
    return hashes


class PrefixIndex:
    def __init__(self) -> None:
        self._table: dict[int, dict[Any, None]] = {}  # block-chain hash -> entries (ordered set)
        self._entries: dict[Any, tuple[list[int], list[int]]] = {}  # entry -> (tokens, hashes)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry: Any) -> bool:
        return entry in self._entries

    def add(self, entry: Any, tokens: list[int]) -> None:
        """Index ``entry`` as holding the KV cache of ``tokens`` (at least)."""
        self.remove(entry)
        hashes = _block_hashes(tokens)
        self._entries[entry] = (tokens, hashes)
        for h in hashes:
            self._table.setdefault(h, {})[entry] = None

    def remove(self, entry: Any) -> None:
        if entry not in self._entries:
            return
        _, hashes = self._entries.pop(entry)
        for h in hashes:
            bucket = self._table[h]
            del bucket[entry]
            if not bucket:
                del self._table[h]

    def tokens(self, entry: Any) -> list[int]:
        return self._entries[entry][0]

    def best(self, prompt: list[int], prefer: type | None = None) -> tuple[Any, int]:
        """(entry, length of the common prefix) maximising that length; (None, 0) below one block.

        Among equal lengths, an entry of type ``prefer`` wins (the engine prefers parked caches it can
        take over without a copy).
        """
        candidates, h, base = None, 0, 0
        for j in range(len(prompt) // BLOCK):
            h = hash((h, tuple(prompt[j * BLOCK:(j + 1) * BLOCK])))
            bucket = self._table.get(h)
            if not bucket:
                break
            candidates, base = bucket, (j + 1) * BLOCK
        if not candidates:
            return None, 0
        best, best_len = None, -1
        for entry in candidates:
            tokens = self._entries[entry][0]
            n, end = base, min(len(tokens), len(prompt))
            while n < end and tokens[n] == prompt[n]:
                n += 1
            if n > best_len or (n == best_len and prefer is not None and isinstance(entry, prefer)):
                best, best_len = entry, n
        if self._entries[best][0][:base] != prompt[:base]:  # a hash collision: play safe
            return None, 0
        return best, best_len


def common_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (at most ``limit``; C-speed slice comparisons,
    bisecting the first difference)."""
    n = min(len(a), len(b), len(a) if limit is None else limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid - 1)
    return lo


class _Parked:
    """The KV cache of a finished request (prompt + all but its last token), kept for reuse."""

    __slots__ = ("tokens",)

    def __init__(self, tokens: list[int]):
        self.tokens = tokens


class SlotTable:
    """Who owns which KV-cache slot: running requests in ``0..n-1``, parked caches and free slots after.

    ``lookup`` + ``place`` put a new request into slot ``n``, starting from the best cached prefix:
    a parked cache that the prompt fully extends is taken over (moved into place unless it is there already);
    any other shared prefix (a running request's prompt, part of a parked cache) is copied. ``retire`` removes
    finished requests, parks their caches and closes the holes by moving in requests from the tail (a parked
    cache in the way moves to a free slot). A move copies one slot's cached tokens once (into a free slot),
    where an exchange of two slots copied both and one of them twice.
    Parked caches are evicted least-recently-used beyond ``max_parked``.

    A copy skips the positions the destination holds already. A slot's memory keeps its keys and values after its
    owner leaves (``_ghost``), and the table knows which tokens each slot holds and under which weights (``_epoch``,
    counted by ``drop_prefixes``). Slots are mostly filled by conversations of one environment, so a destination
    usually holds the same system prompt and tool list, and often a task's whole first prompt (a group's samples).
    """

    def __init__(self, runner: Any, max_parked: int, reuse: bool = True):
        self.runner, self.reuse = runner, reuse
        self.max_parked = max_parked if reuse else 0
        self.running: list[Any] = []
        self._owner: list[Any] = []  # slot -> running request, _Parked, or None (free)
        self._slot: dict[Any, int] = {}
        self._parked: dict[_Parked, None] = {}  # insertion order = LRU order
        self._index = PrefixIndex()
        self._epoch = 0  # the weights' epoch (drop_prefixes starts a new one)
        self._epochs: dict[Any, int] = {}  # running request or parked cache -> the epoch its keys were computed in
        self._ghost: dict[int, tuple[list[int], int]] = {}  # free slot -> (tokens its memory holds, their epoch)
        self._shared: int | None = None  # shared_prompt(running), until the running requests change

    def shared_prompt(self) -> int:
        """``shared_prompt`` of the running requests (computed once while they stay the same)."""
        if self._shared is None:
            self._shared = shared_prompt(self.running)
        return self._shared

    def lookup(self, prompt: list[int]) -> tuple[Any, int]:
        """Best cached prefix for ``prompt``: (entry, tokens reusable), leaving >= 1 token to compute."""
        entry, n = self._index.best(prompt, prefer=_Parked) if len(self._index) else (None, 0)
        return entry, min(n, len(prompt) - 1)

    def place(self, req: Any, entry: Any, n: int) -> int:
        """Put ``req`` into slot ``len(running)`` with its first ``n`` prompt tokens taken from
        ``entry`` (from ``lookup``); returns ``n``, the tokens already cached."""
        t = len(self.running)
        self._grow(t + 1)
        epoch = self._epoch  # of the keys the request starts from (-1: not all of one epoch)
        if isinstance(entry, _Parked) and n >= len(entry.tokens) - 1 and n > 0:  # take it over
            if self._slot[entry] != t:
                self._vacate(t)  # (not into the entry's slot: it is still owned)
                self._move(self._slot[entry], t)
            epoch = self._epochs.get(entry, -1)
            self._forget(entry)
            self.runner.truncate(t, n)
        else:
            self._vacate(t)
            if entry is not None and n > 0:
                src = self._slot[entry]
                self.runner.copy_prefix(src, t, n, self._common(src, t, n))
                epoch = epoch if self._epochs.get(entry) == epoch else -1
                if isinstance(entry, _Parked):  # recently useful: evict it last
                    self._parked.pop(entry)
                    self._parked[entry] = None
            else:
                self.runner.truncate(t, 0)
                n = 0
        self._owner[t], self._slot[req], self._epochs[req] = req, t, epoch
        self.running.append(req)
        self._shared = None
        return n

    def index(self, req: Any) -> None:
        """Offer a running request's prompt (its KV is computed now) as a prefix for later requests."""
        if self.reuse:
            self._index.add(req, req.prompt)

    def retire(self, done: list[bool], park: list[bool]) -> None:
        """Remove the requests with ``done[i]`` (parking those with ``park[i]``) and compact."""
        running = self.running
        for i, req in enumerate(running):
            if done[i]:
                epoch = self._epochs.get(req, -1)
                self._forget(req)
                if park[i] and self.max_parked > 0:
                    p = _Parked((req.prompt + req.tokens)[:-1])  # the last token was never fed back
                    self._owner[i], self._slot[p], self._parked[p], self._epochs[p] = p, i, None, epoch
                    self._index.add(p, p.tokens)
        n = len(running) - sum(done)
        holes = [i for i in range(n) if done[i]]
        movers = [i for i in range(n, len(running)) if not done[i]]
        for a, b in zip(holes, movers):  # a running request from the tail fills each hole; a parked cache there moves
            self._vacate(a, beyond=len(running))
            self._move(b, a)
        self.running = [self._owner[i] for i in range(n)]
        self._shared = None
        while len(self._parked) > self.max_parked:
            self._forget(next(iter(self._parked)))

    def drop_prefixes(self, running_too: bool) -> None:
        """After a weight change: forget the parked caches, and stop offering the running requests'
        prompts as prefixes unless their caches are recomputed."""
        for p in list(self._parked):
            self._forget(p)
        self._epoch += 1
        self._ghost.clear()
        if running_too:
            for req in self.running:
                self._index.remove(req)
        else:  # their caches are recomputed under the new weights (LocalEngine._refill)
            for req in self.running:
                self._epochs[req] = self._epoch

    def clear(self) -> None:
        for entry in list(self._slot):
            self._forget(entry)
        self.running = []
        self._ghost.clear()
        self._shared = None

    # --- internals ---------------------------------------------------------------------------------

    def _grow(self, n: int) -> None:
        self._owner.extend([None] * (n - len(self._owner)))

    def _forget(self, entry: Any) -> None:
        """Drop ``entry``'s bookkeeping; its slot becomes free (its memory still holds ``entry``'s tokens)."""
        slot = self._slot.get(entry)
        if slot is not None and self._owner[slot] is entry:
            self._haunt(slot)
            self._owner[slot] = None
        self._index.remove(entry)
        self._parked.pop(entry, None)
        self._slot.pop(entry, None)
        self._epochs.pop(entry, None)

    def _move(self, src: int, dst: int) -> None:
        """Slot ``src``'s cache and owner into the free slot ``dst`` (one copy of the tokens ``dst`` does not hold
        already; ``src`` becomes free, its memory as it was)."""
        self.runner.move(src, dst, self._common(src, dst, None))
        self._haunt(src)
        self._relabel(src, dst)

    def _haunt(self, slot: int) -> None:
        """``slot`` is about to be freed: remember what its memory holds."""
        if self.reuse:
            self._ghost[slot] = self._held(slot)

    def _held(self, slot: int) -> tuple[list[int], int]:
        """(the tokens whose keys and values ``slot``'s memory holds, the epoch they were computed in)."""
        owner = self._owner[slot] if slot < len(self._owner) else None
        if owner is None:
            return self._ghost.get(slot, ([], -1))
        tokens = owner.tokens if isinstance(owner, _Parked) else owner.prompt + owner.tokens
        return tokens[:self.runner.length(slot)], self._epochs.get(owner, -1)

    def _common(self, src: int, dst: int, n: int | None) -> int:
        """How many of the first ``n`` tokens of ``src`` (None: all it holds) slot ``dst`` holds already."""
        if not self.reuse:
            return 0
        b, eb = self._held(dst)
        if eb < 0 or not b:  # nothing (of any weights) to keep: the source's tokens are not needed
            return 0
        a, ea = self._held(src)
        return common_prefix(a, b, n) if ea == eb else 0

    def _relabel(self, a: int, b: int) -> None:
        """Slots a and b exchanged their contents: follow with the bookkeeping."""
        self._owner[a], self._owner[b] = self._owner[b], self._owner[a]
        for s in (a, b):
            if self._owner[s] is not None:
                self._slot[self._owner[s]] = s

    def _vacate(self, t: int, beyond: int = 0) -> None:
        """Move a parked cache out of slot ``t`` into a free slot after ``t`` and at least ``beyond``."""
        if self._owner[t] is None:
            return
        start = max(t + 1, beyond)
        free = next((s for s in range(start, len(self._owner)) if self._owner[s] is None), max(start, len(self._owner)))
        self._grow(free + 1)
        self._move(t, free)


MIN_SHARED_PROMPT = 32  # tokens; below this the decode step attends over every slot's own keys


def shared_prompt(running: list[Any]) -> int:
    """How many leading prompt tokens every running request has in common (the system prompt and tool list of
    an environment's episodes; a group's whole first prompt), 0 below ``MIN_SHARED_PROMPT`` or for one request.
    The decode step reads their keys and values once for all (``LlamaFamilyRunner.decode``'s ``shared``);
    ``running``: objects with a ``prompt`` token list."""
    if len(running) < 2:
        return 0
    ref = running[0].prompt
    p = min(len(r.prompt) for r in running)
    for r in running[1:]:
        p = common_prefix(r.prompt, ref, p)
        if p < MIN_SHARED_PROMPT:
            return 0
    return p
