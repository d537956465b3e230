"""Runtime stage: what the hit path keeps per owner (a region input, an argument position, a graph), and for how long.

Input: a ``Kept`` the hit path keeps entries in (views by data pointer or by tensor, weight copies by weight, memos
by anchor, plans by dispatch key) and a new entry, with the tensors it was made from. Output: the ``Kept`` with the
entry, emptied first when it already holds its limit of entries (``KEPT_PER_OWNER`` by default: a graph called with
ever-new tensors keeps working, with bounded memory, and starts keeping again from the next call; a store whose
entries each belong to one live object, as the weight copies do, has no limit); the entry is dropped again as soon as
any tensor it was made from dies, so nothing the hit path keeps outlives the model whose weights it views: a freed
model frees its memory, as it does without us.
"""

from __future__ import annotations

import functools
import weakref

# Entries kept per owner: the blocks of one class that diffusers' regional compile calls one graph with, in turn
# (Flux has 19 + 38, Wan 30-40), with room to spare.
KEPT_PER_OWNER = 64


class Kept(dict):
    """``key -> entry``, at most ``limit`` of them (None: no limit); an entry kept with ``owners`` lives no longer
    than the first of them to die. Readers use the plain dict's ``get``.

    While an entry with owners is present its owners are alive, so it may key or compare them by ``id`` without
    holding them (holding one would keep it alive for good). A weak reference's callback runs while its object is
    deallocated, before its id can be reused. A callback may run in any thread; racing a ``keep`` of the same key,
    it may drop the newer entry, which costs one remake and is never a wrong entry."""

    def __init__(self, limit: int | None = KEPT_PER_OWNER):
        super().__init__()
        self.limit = limit
        self.lifelines: dict = {}  # key -> weak references to the owners of the entry kept there

    def keep(self, key, entry, owners: tuple = ()) -> None:
        """``self[key] = entry``, emptying ``self`` first when it is full; dropped when any of ``owners`` dies."""
        if self.limit is not None and len(self) >= self.limit:
            self.clear()
            self.lifelines.clear()
        self[key] = entry
        if owners:
            forget = functools.partial(self.forget, key)
            self.lifelines[key] = tuple(weakref.ref(owner, forget) for owner in owners)
        else:
            self.lifelines.pop(key, None)

    def drop(self, key) -> None:
        """Drop the entry at ``key``, if any."""
        self.pop(key, None)
        self.lifelines.pop(key, None)

    def forget(self, key, dead: weakref.ref) -> None:
        """An owner died: drop the entry at ``key`` if it is still the one that owner's reference was made for."""
        lifelines = self.lifelines.get(key)
        if lifelines is not None and any(lifeline is dead for lifeline in lifelines):
            self.drop(key)
