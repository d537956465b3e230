"""passes/decompose: the ops kept whole stay in the ATen graph, and keeping them makes graphs bit-identical."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from neuron_compile.passes.decompose import KEPT_WHOLE, decomposition_table

aten = torch.ops.aten


def test_kept_ops_are_not_in_the_table_and_the_rest_is_core_aten():
    table = decomposition_table()
    assert not set(KEPT_WHOLE) & set(table)
    assert aten.addcmul.default in table and aten.hardswish.default in table
    table.clear()  # a copy: clearing it leaves ours intact
    assert aten.addcmul.default in decomposition_table()


# Run in a new process: there, ours is built before anything has made every op overload (torch's table does).
SAME_TABLE_SCRIPT = """
import functools, torch
from torch._decomp import core_aten_decompositions
from neuron_compile.passes.decompose import core_aten_table

def same(ours, torchs):  # the same function, or a CIA op's entry: a new closure per call, of the same code and op
    if ours is torchs:
        return True
    return (isinstance(ours, functools.partial) and isinstance(torchs, functools.partial)
            and ours.func.__code__ is torchs.func.__code__ and ours.args == torchs.args
            and ours.keywords == torchs.keywords)

ours = core_aten_table()
torchs = dict(core_aten_decompositions())
assert set(ours) == set(torchs), sorted(map(str, set(ours) ^ set(torchs)))
assert all(same(ours[op], torchs[op]) for op in torchs), [str(op) for op in torchs if not same(ours[op], torchs[op])]
assert torch.ops.aten.upsample_nearest2d.default in ours  # its CIA kernel is registered in Python only
print(len(ours))
"""


def test_the_core_table_is_torchs_entry_by_entry():
    done = subprocess.run([sys.executable, "-c", SAME_TABLE_SCRIPT], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 900


# Ops kept whole because their decompositions round differently from ATen's kernels (see the module docstring).
# Each function with the forward and backward ops that must appear whole in its ATen graphs.
KEPT_FOR_EXACTNESS = {
    "silu": (F.silu, {aten.silu.default, aten.silu_backward.default}),
    "gelu": (F.gelu, {aten.gelu.default, aten.gelu_backward.default}),
    "softmax": (lambda x: x.softmax(-1), {aten._softmax.default, aten._softmax_backward_data.default}),
    "log_softmax": (
        lambda x: x.log_softmax(-1),
        {aten._log_softmax.default, aten._log_softmax_backward_data.default},
    ),
    "layer_norm": (
        lambda x: F.layer_norm(x, (x.shape[-1],)),
        {aten.native_layer_norm.default, aten.native_layer_norm_backward.default},
    ),
    "batch_norm": (
        lambda x: F.batch_norm(x, None, None, training=True),
        {aten.native_batch_norm_backward.default},
    ),
    "cross_entropy": (
        lambda x: F.cross_entropy(x, torch.arange(x.shape[0]) % x.shape[1]),
        {aten.nll_loss_forward.default, aten.nll_loss_backward.default},
    ),
    "attention": (
        lambda x: F.scaled_dot_product_attention(*[x.view(2, 2, 4, 32)] * 3),  # [batch, heads, seq, dim]
        {aten._scaled_dot_product_flash_attention_for_cpu.default},
    ),
}


@pytest.mark.parametrize("name", sorted(KEPT_FOR_EXACTNESS))
def test_kept_ops_run_bit_identical_to_eager_forward_and_backward(name):
    fn, whole_ops = KEPT_FOR_EXACTNESS[name]
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep_graph, bw_compiler=keep_graph, decompositions=decomposition_table())
    torch.manual_seed(0)
    eager_input = (torch.randn(16, 32) * 3).requires_grad_()
    compiled_input = eager_input.detach().clone().requires_grad_()
    eager_out, compiled_out = fn(eager_input), torch.compile(fn, backend=backend)(compiled_input)
    eager_out.square().sum().backward()
    compiled_out.square().sum().backward()
    torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=0)
    torch.testing.assert_close(compiled_input.grad, eager_input.grad, rtol=0, atol=0)
    graph_ops = {node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert whole_ops <= graph_ops
    torch._dynamo.reset()
