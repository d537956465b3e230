"""runtime/cache: signatures, keys, and the dispatch cache's compile-once / LRU / retry-on-failure behaviour."""

import threading

import pytest
import torch

from neuron_compile.config import Config
from neuron_compile.runtime.cache import DispatchCache, GraphKey, ScalarSignature, TensorSignature, signature_of

DEFAULT = Config()


def key(*args, config=DEFAULT):
    return GraphKey("graph", signature_of(args), config)


def test_signature_covers_shape_stride_offset_dtype_and_scalars():
    base = torch.zeros(4, 6)
    (view,) = signature_of([base.t()[1:]])  # base.t() is (6, 4) with strides (1, 6); [1:] starts 1 element in
    assert view == TensorSignature((5, 4), (1, 6), 1, "torch.float32", "cpu")
    assert signature_of([3, 2.5, True]) == (
        ScalarSignature("int", 3),
        ScalarSignature("float", 2.5),
        ScalarSignature("bool", True),
    )
    assert key(torch.zeros(2, 3)) == key(torch.ones(2, 3))  # values do not matter
    assert key(torch.zeros(2, 3)) != key(torch.zeros(3, 2))
    assert key(torch.zeros(2, 3)) != key(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert key(torch.zeros(2, 3)) != key(torch.zeros(2, 3), config=Config(target="trn1"))


def test_compiles_once_per_key_then_hits():
    cache, compiled = DispatchCache(), []
    for shape in [(2,), (3,), (2,)]:
        cache.get_or_compile(key(torch.zeros(shape)), lambda: compiled.append(1) or len(compiled))
    assert len(compiled) == 2 and len(cache) == 2
    assert cache.get_or_compile(key(torch.zeros(2)), lambda: pytest.fail("recompiled")) == (1, False)


def test_least_recently_used_signature_is_evicted():
    cache = DispatchCache(max_entries=2)
    first, second, third = (key(torch.zeros(size)) for size in (1, 2, 3))
    cache.get_or_compile(first, lambda: "first")
    cache.get_or_compile(second, lambda: "second")
    cache.get_or_compile(first, lambda: "again")  # touch: second is now the oldest
    cache.get_or_compile(third, lambda: "third")
    assert first in cache and third in cache and second not in cache


def test_repeated_hits_on_one_key_keep_it_the_most_recently_used():
    cache = DispatchCache(max_entries=2)
    first, second, third = (key(torch.zeros(size)) for size in (1, 2, 3))
    cache.get_or_compile(first, lambda: "first")
    assert cache.lookup(first) == "first" and cache.lookup(first) == "first"  # the second one: the last-hit path
    cache.get_or_compile(second, lambda: "second")
    assert cache.lookup(first) == "first" and cache.lookup(first) == "first"  # touched again after second came
    cache.get_or_compile(third, lambda: "third")
    assert first in cache and third in cache and second not in cache
    assert cache.lookup(key(torch.zeros(2))) is None  # an equal key, not the same object, is looked up by value


def test_a_failed_compile_is_not_cached():
    cache = DispatchCache()

    def fail():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        cache.get_or_compile(key(torch.zeros(1)), fail)
    assert cache.get_or_compile(key(torch.zeros(1)), lambda: "ok") == ("ok", True)


def test_racing_threads_compile_once():
    cache, compiles, start = DispatchCache(), [], threading.Barrier(4)

    def slow_compile():
        compiles.append(1)
        return "entry"

    def call():
        start.wait()
        cache.get_or_compile(key(torch.zeros(7)), slow_compile)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert compiles == [1]
