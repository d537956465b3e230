"""Runtime stage: the one bound on what the hit path keeps per owner (a region input, an argument position, a graph).

Input: a dict the hit path keeps entries in (views by data pointer, weight copies by weight, memos by anchor) and a
new entry. Output: the dict with the entry, emptied first when it already holds ``KEPT_PER_OWNER`` entries: a graph
called with ever-new tensors keeps working, with bounded memory, and starts keeping again from the next call.
"""

from __future__ import annotations

# Entries kept per owner: the blocks of one class that diffusers' regional compile calls one graph with, in turn
# (Flux has 19 + 38, Wan 30-40), with room to spare.
KEPT_PER_OWNER = 64


def keep(kept: dict, key, entry) -> None:
    """``kept[key] = entry``, emptying ``kept`` first when it holds ``KEPT_PER_OWNER`` entries."""
    if len(kept) >= KEPT_PER_OWNER:
        kept.clear()
    kept[key] = entry
