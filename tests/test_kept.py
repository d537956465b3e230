"""runtime/kept.py: entries bounded per owner, dropped when a tensor they were made from dies."""

import gc

import torch

from neuron_compile.runtime.kept import KEPT_PER_OWNER, Kept


def test_a_full_store_empties_before_keeping_more():
    kept = Kept()
    for key in range(KEPT_PER_OWNER):
        kept.keep(key, key)
    assert len(kept) == KEPT_PER_OWNER
    kept.keep("next", 1)
    assert dict(kept) == {"next": 1}


def test_a_store_without_a_limit_keeps_every_entry():
    kept = Kept(limit=None)
    for key in range(3 * KEPT_PER_OWNER):
        kept.keep(key, key)
    assert len(kept) == 3 * KEPT_PER_OWNER


def test_an_entry_goes_when_its_owner_dies_and_only_then():
    kept = Kept(limit=None)
    owner, other = torch.ones(2), torch.ones(3)
    kept.keep("a", "entry a", owners=(owner,))
    kept.keep("b", "entry b", owners=(other,))
    gc.collect()
    assert dict(kept) == {"a": "entry a", "b": "entry b"}
    del owner
    gc.collect()
    assert dict(kept) == {"b": "entry b"}
    assert "a" not in kept.lifelines


def test_the_death_of_a_replaced_entrys_owner_leaves_the_new_entry():
    kept = Kept()
    old, new = torch.ones(2), torch.ones(2)
    kept.keep("key", "old", owners=(old,))
    kept.keep("key", "new", owners=(new,))
    del old
    gc.collect()
    assert kept.get("key") == "new"
    del new
    gc.collect()
    assert kept.get("key") is None


def test_an_entry_with_several_owners_goes_with_the_first_to_die():
    kept = Kept()
    first, second = torch.ones(1), torch.ones(1)
    kept.keep("key", "entry", owners=(first, second))
    del second
    gc.collect()
    assert "key" not in kept
