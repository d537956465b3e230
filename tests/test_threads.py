"""One compiled model called from several threads with different shapes; specialization never poisons Dynamo."""

import threading

import pytest
import torch

import neuron_compile  # noqa: F401 -- registers the backend
from neuron_compile.passes import specialize as specialize_module
from neuron_compile.runtime.simulator import blas_threads


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _fx_state():
    return torch.fx._symbolic_trace._is_fx_tracing_flag, torch.nn.Module.__getattr__, torch.nn.Module.__call__


@pytest.mark.parametrize("repeat", range(3))
def test_four_threads_with_different_shapes(repeat):
    before = _fx_state()
    torch.manual_seed(repeat)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    compiled = torch.compile(model, backend="neuron")
    errors = []
    start = threading.Barrier(4)

    def work(rows):
        try:
            start.wait()
            for _ in range(2):
                x = torch.randn(rows, 16)
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        except Exception as error:  # noqa: BLE001 -- collected and reported below
            errors.append(f"{rows}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=work, args=(rows,)) for rows in (3, 5, 7, 9)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert _fx_state() == before
    fresh = torch.compile(lambda x: x.sin() + 1, backend="neuron")
    torch.testing.assert_close(fresh(torch.ones(3)), torch.ones(3).sin() + 1)


def test_specialization_sets_no_process_wide_fx_state():
    seen = []

    def probe(x):  # runs inside the specialization pass, as any node does
        seen.append(_fx_state())
        return torch.ops.aten.mul.Tensor(x, 2)

    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x: torch.ops.aten.sin.default(x) * x.shape[0],
                                                    tracing_mode="symbolic")(torch.randn(4))
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sin.default)
    with gm.graph.inserting_after(node):
        probed = gm.graph.call_function(probe, (node,))
    node.replace_all_uses_with(probed, delete_user_cb=lambda user: user is not probed)
    gm.recompile()
    before = _fx_state()
    specialized = specialize_module.specialize(gm, [torch.randn(6)])
    assert seen == [before]  # make_fx would have run the probe with the flag set and Module patched
    x = torch.randn(6)
    torch.testing.assert_close(specialized(x), torch.sin(x) * 2 * 6)


def test_failure_mid_specialization_does_not_poison_later_compiles():
    def fails_on_fakes(x):
        if isinstance(x, torch._subclasses.FakeTensor):
            raise RuntimeError("specialization failed here")
        return x + 1

    def fn(x):
        return torch.cos(x) * 2

    before = _fx_state()
    compiled = torch.compile(fn, backend="neuron", dynamic=True)
    real = specialize_module._propagate

    def broken(gm, args, mode):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        with gm.graph.inserting_before(node):
            gm.graph.call_function(fails_on_fakes, (next(iter(gm.graph.nodes)),))
        return real(gm, args, mode)

    specialize_module._propagate = broken
    try:
        with pytest.warns(neuron_compile.NeuronCompileWarning, match="specialization failed here"):
            torch.testing.assert_close(compiled(torch.ones(5)), fn(torch.ones(5)))
    finally:
        specialize_module._propagate = real
    assert _fx_state() == before
    torch._dynamo.reset()
    again = torch.compile(fn, backend="neuron", dynamic=True)
    torch.testing.assert_close(again(torch.ones(7)), fn(torch.ones(7)), rtol=1e-5, atol=1e-6)


def test_blas_thread_count_restored_after_overlapping_launches():
    if blas_threads._OPENBLAS is None:
        pytest.skip("numpy's BLAS is not OpenBLAS")
    getter = blas_threads._OPENBLAS[0]
    before = getter()
    outer, inner = blas_threads.single_threaded_blas(), blas_threads.single_threaded_blas()
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # the first launch ends while the second still runs
    assert getter() == 1
    inner.__exit__(None, None, None)
    assert getter() == before
