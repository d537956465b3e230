"""Fusion: which nodes share a kernel, why the others do not, and that random fused graphs still match eager."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, random_tensor, trace
from neuron_compile import config, ir, kinds
from neuron_compile.hardware import get_target
from neuron_compile.lowering import lower_graph
from neuron_compile.passes.fusion import can_fuse, fuse, inline_cheap


def _fused(fn, *inputs):
    lowered = lower_graph(trace(fn, *inputs))
    return lowered, fuse(lowered.nodes, {value.buffer for value in lowered.outputs})


def test_pointwise_chain_is_one_kernel_with_only_the_output_stored():
    x, y = random_tensor((64, 32)), random_tensor((32,))
    lowered, result = _fused(lambda x, y: torch.sigmoid(x * y + 1) - x, x, y)
    assert len(lowered.nodes) == 4 and len(result.kernels) == 1
    assert [store.buffer.name for store in result.kernels[0].stores] == [lowered.outputs[0].buffer]


def test_intermediate_needed_outside_is_stored_too():
    def fn(x):
        doubled = x * 2
        return doubled, doubled.exp()

    x = random_tensor((16, 8))
    _, result = _fused(fn, x)
    assert len(result.kernels) == 1 and len(result.kernels[0].stores) == 2
    check_against_eager(fn, x)


def test_read_through_a_transpose_does_not_fuse_and_says_why():
    x = random_tensor((16, 16))
    _, result = _fused(lambda x: (x * 2).t() + x, x)
    assert len(result.kernels) == 2
    assert any("view that changes the index map" in decision for decision in result.decisions)
    check_against_eager(lambda x: (x * 2).t() + x, x)


def test_softmax_prologue_and_epilogue_fuse():
    x = random_tensor((33, 65))
    _, result = _fused(lambda x: torch.softmax(x * 0.5, -1) * 3, x)
    assert len(result.kernels) == 1 and isinstance(result.kernels[0], ir.RowNormalize)


def test_reduction_prologue_with_outside_consumer_stays_separate():
    def fn(x):
        shifted = x + 1
        return shifted, shifted.sum(0)

    x = random_tensor((8, 8))
    _, result = _fused(fn, x)
    assert len(result.kernels) == 2
    assert any("needed outside the kernel" in decision for decision in result.decisions)


def test_can_fuse_rejects_a_matmul_consumer():
    x = random_tensor((8, 8))
    lowered = lower_graph(trace(lambda x: torch.mm(x + 1, x), x))
    assert "start their own kernel" in can_fuse(lowered.nodes[0], lowered.nodes[1], set())


def test_no_fusion_creates_a_cycle():
    # b depends on a, c on a reduction of a; fusing c into a's group would need the reduction inside it.
    x = random_tensor((8, 8))
    lowered, result = _fused(lambda x: (x.exp() + x.exp().sum(0, keepdim=True)), x)
    writers = {store.buffer.name: i for i, kernel in enumerate(result.kernels) for store in kernel.stores}
    graph = nx.DiGraph()
    for i, kernel in enumerate(result.kernels):
        graph.add_node(i)
        for load in kinds.loads(kernel):
            if load.buffer in writers:
                graph.add_edge(writers[load.buffer], i)
    assert nx.is_directed_acyclic_graph(graph)
    assert all(writers[load.buffer] < i for i, kernel in enumerate(result.kernels) for load in kinds.loads(kernel)
               if load.buffer in writers)
    check_against_eager(lambda x: (x.exp() + x.exp().sum(0, keepdim=True)), x)


# No exp: exp(exp(x)) turns one bf16 rounding of its argument into a 10 % difference, whoever rounds where.
UNARY_STEPS = [torch.sigmoid, torch.tanh, torch.relu, torch.sigmoid, lambda v: v * 0.5, lambda v: v - 1.0,
               lambda v: v.clamp(-1, 1), lambda v: v.abs()]
BINARY_STEPS = [torch.add, torch.mul, torch.maximum, torch.sub]
# Row sums are scaled by the row length: a plain sum of 130 cancelling bf16 terms carries ~0.3 of rounding
# noise (in eager too), beyond any fixed tolerance; the scaled sum still runs the sum lowering and its epilogue.
REDUCE_STEPS = [lambda v: v.sum(-1, keepdim=True) / v.shape[-1], lambda v: v.amax(0), lambda v: v.mean(-1, keepdim=True),
                lambda v: torch.softmax(v, -1)]


@st.composite
def programs(draw):
    return [(draw(st.sampled_from(["unary", "binary", "reduce"])), draw(st.integers(0, 7)), draw(st.integers(0, 9)))
            for _ in range(draw(st.integers(1, 6)))]


def _run_program(program, x, y):
    values = [x, y]
    for kind, op, pick in program:
        a = values[pick % len(values)]
        if kind == "unary" or (kind == "reduce" and a.dim() < 2):  # keep reductions to tensors with rows
            values.append(UNARY_STEPS[op](a))
        elif kind == "binary":
            values.append(BINARY_STEPS[op % 4](a, values[(pick + 1) % len(values)]))
        else:
            values.append(REDUCE_STEPS[op % 4](a))
    return tuple(values[2:])


@settings(max_examples=25, deadline=None)
@given(program=programs(), rows=st.sampled_from([1, 5, 129]), cols=st.sampled_from([1, 7, 130]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_random_graphs_match_eager(program, rows, cols, dtype):
    x, y = random_tensor((rows, cols), dtype, seed=1), random_tensor((rows, cols), dtype, seed=2)
    # Reductions of up to 130 x 129 fp32 terms summed in another order: 1e-4 (bf16 as in lowering_harness).
    check_against_eager(lambda x, y: _run_program(program, x, y), x, y,
                        tolerances={torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)})


def test_rms_norm_is_one_kernel_reading_the_row_once():
    def rms_norm(x, weight):
        return torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * x * weight

    x, weight = random_tensor((3, 130, 64), seed=3), random_tensor((64,), seed=4)
    region = check_against_eager(rms_norm, x, weight)
    assert len(region.kernels) == 1 and isinstance(_fused(rms_norm, x, weight)[1].kernels[0], ir.Reduction)
    assert region.kernels[0].source.count("src=arg0_1.ap(") == 1  # x is loaded once per row tile


@settings(max_examples=10, deadline=None)
@given(rows=st.sampled_from([1, 5, 129]), cols=st.sampled_from([1, 7, 130]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_row_epilogues_match_eager(rows, cols, dtype):
    def fn(x, y):
        centered = x - x.mean(-1, keepdim=True)
        return centered / (x.amax(-1, keepdim=True).abs() + 1), y * x.sum(-1, keepdim=True) - 1.0 / (y.abs() + 1)

    x, y = random_tensor((rows, cols), dtype, seed=5), random_tensor((rows, cols), dtype, seed=6)
    check_against_eager(fn, x, y, tolerances={torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)})


def test_a_buffer_written_by_two_kernels_is_refused():
    # Each launch returns its output buffers whole: two writers of one buffer would lose the first's elements.
    import pytest

    from neuron_compile.pipeline import check_single_writer
    from neuron_compile.lowering import LoweringError

    buffer = ir.Buffer("out", "float32", ir.Layout((4, 8), (8, 1)))
    halves = [ir.Layout((4, 4), (8, 1), offset) for offset in (0, 4)]
    nodes = [ir.Pointwise(f"kernel_{i}", (4, 4), (ir.Store(buffer, ir.Scalar(float(i)), layout),))
             for i, layout in enumerate(halves)]
    check_single_writer(nodes[:1])
    with pytest.raises(LoweringError, match="buffer out is written by two kernels"):
        check_single_writer(nodes)


def test_size_one_dims_do_not_block_fusion():
    # Eager gives a size-1 dim its contiguous stride, a view reading it stride 0: the same index map. The
    # transformers RMSNorm over a (1, seq, hidden) batch (cast up, square, mean, rsqrt of the guarded sum, scale,
    # cast down, weight) fused into two kernels, where it had been eight.
    def hf_rms_norm(x, weight):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return weight * h.to(torch.bfloat16)

    x, weight = random_tensor((1, 130, 2048), torch.bfloat16, seed=5), random_tensor((2048,), torch.bfloat16, seed=6)
    region = check_against_eager(hf_rms_norm, x, weight)
    decisions = "\n".join(_fused(hf_rms_norm, x, weight)[1].decisions)
    assert "changes the index map" not in decisions, decisions
    assert len(region.kernels) <= 2
    y = random_tensor((1, 1, 8, 1, 16), seed=7)
    lowered, result = _fused(lambda y: torch.sigmoid(y * 2) + 1, y)
    assert len(result.kernels) == 1


def test_row_epilogue_loads_a_per_row_value_once_per_partition():
    # A (rows, 1) operand of a row epilogue is constant along the row: it is loaded as a (P, 1) column, not
    # broadcast over the row by a DMA that moves every repeated element (a 4-byte run each).
    x, scale = random_tensor((130, 300), seed=8), random_tensor((130, 1), seed=9)
    region = check_against_eager(lambda x, s: (x - x.amax(-1, keepdim=True)) * s, x, scale)
    (kernel,) = region.kernels
    assert "[0, cols]" not in kernel.source and "arg1_1.ap([[1, rows], [0, 1]]" in kernel.source, kernel.source


# ---------------------------------------------------------------- concat: prologues inlined, epilogues distributed


def _rotary_freqs(inv_freq):
    freqs = torch.arange(40).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def test_cat_takes_its_producer_and_its_pointwise_consumers_into_one_kernel():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    lowered, result = _fused(_rotary_freqs, inv_freq)
    # the positions (arange, a [40] domain) are their own kernel; freqs, the cat, cos and sin are one
    assert [type(kernel) for kernel in result.kernels] == [ir.Pointwise, ir.Concat]
    written = {store.buffer.name for store in result.kernels[1].stores}
    assert written == {value.buffer for value in lowered.outputs}  # the concatenation itself never reaches HBM
    check_against_eager(_rotary_freqs, inv_freq)


def _rotate_half_times(x, sin, weight):
    rotated = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
    return rotated * sin + weight  # sin [rows, 16] and a broadcast [16] weight: each part reads its slice


def test_rotate_half_is_one_kernel_and_its_other_operands_are_sliced():
    x, sin, weight = random_tensor((3, 70, 16), seed=1), random_tensor((70, 16), seed=2), random_tensor((16,), seed=3)
    _, result = _fused(_rotate_half_times, x, sin, weight)
    assert len(result.kernels) == 1 and isinstance(result.kernels[0], ir.Concat)
    check_against_eager(_rotate_half_times, x, sin, weight)
    check_against_eager(_rotate_half_times, x.bfloat16(), sin.bfloat16(), weight.bfloat16())


def test_a_cat_needed_outside_is_still_written_and_a_changed_index_map_is_refused():
    def fn(a, b):
        joined = torch.cat((a, b), dim=1)
        return joined, joined * 2, joined.flip(1) + 1

    a, b = random_tensor((12, 5), seed=4), random_tensor((12, 7), seed=5)
    _, result = _fused(fn, a, b)
    concat = next(kernel for kernel in result.kernels if isinstance(kernel, ir.Concat))
    assert len(concat.stores) == 2  # the cat (read by the flipped consumer, and an output) and joined * 2
    assert any("view that changes the index map" in decision for decision in result.decisions)
    check_against_eager(fn, a, b)


def test_pad_and_slice_scatter_distribute_their_epilogues_over_every_part():
    def fn(x, y):
        padded = torch.nn.functional.pad(x, (2, 3, 1, 0), value=-1.5) * 2 + 1
        scattered = torch.slice_scatter(x, y, dim=1, start=2, end=5).exp()
        return padded, scattered

    x, y = random_tensor((9, 11), seed=6), random_tensor((9, 3), seed=7)
    _, result = _fused(fn, x, y)
    assert sum(isinstance(kernel, ir.Concat) for kernel in result.kernels) == len(result.kernels) == 2
    check_against_eager(fn, x, y)


def test_a_producer_read_outside_the_cat_stays_its_own_kernel():
    def fn(x, y):
        product = x * y  # two inputs: not a cheap node inlined into every reader
        return torch.cat((product, x), dim=0), product.sum()

    x, y = random_tensor((6, 4), seed=8), random_tensor((6, 4), seed=9)
    _, result = _fused(fn, x, y)
    assert any("needed outside the kernel" in decision for decision in result.decisions)
    check_against_eager(fn, x, y)


# ---------------------------------------------------------------- cheap nodes inlined into their readers


def _llama_rms_norm(a, b, weight):
    hidden = a + b  # the residual add (bf16), stored: the next residual reads it too
    x = hidden.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * normed.to(torch.bfloat16), hidden


def test_a_norm_reads_its_bf16_input_not_fp32_copies_of_it():
    a, b = random_tensor((2, 130, 64), torch.bfloat16, seed=10), random_tensor((2, 130, 64), torch.bfloat16, seed=11)
    weight = random_tensor((64,), torch.bfloat16, seed=12)
    lowered, result = _fused(_llama_rms_norm, a, b, weight)
    assert len(lowered.nodes) > len(result.kernels) == 2  # the add; the norm with x.float() and its square inlined
    stored = {store.buffer.name: store.buffer.dtype for kernel in result.kernels for store in kinds.stores(kernel)}
    assert "float32" not in stored.values()  # neither x.float() nor x.float() ** 2 goes through HBM
    norm = next(kernel for kernel in result.kernels if isinstance(kernel, ir.Reduction))
    assert {load.buffer for load in kinds.loads(norm)} <= set(stored) | {buffer.name for buffer in lowered.inputs}
    check_against_eager(_llama_rms_norm, a, b, weight)


def test_cheap_nodes_read_through_another_view_or_returned_are_kept():
    def fn(x):
        doubled = x * 2
        return doubled.t() + x, (x + 1), (x + 1) * 3

    x = random_tensor((16, 16), seed=13)
    lowered, result = _fused(fn, x)
    stored = {store.buffer.name for kernel in result.kernels for store in kinds.stores(kernel)}
    assert len(stored) == 4  # x * 2 (read transposed), x + 1 (an output) and the two results
    check_against_eager(fn, x)


def _adam_like_moments(m, v, g):
    m_new = m * 0.9 + g * 0.1  # first: the update below joins this kernel, not the second moment's
    v_rounded = (v * 0.999 + g.float() * g.float() * 0.001).to(torch.bfloat16)  # an fp32 sum cast down
    return m_new, v_rounded.clone(), m_new / (v_rounded.sqrt() + 1e-8)  # the clone: the state's copy_


def test_a_cast_down_of_a_computed_value_is_not_inlined_so_readers_load_the_narrow_value():
    """AdamW's bf16 second moment: inlined into the update's kernel, the cast made it load the fp32 sum, which
    the moment's kernel then stored (4 bytes written and read per element instead of 2). The moment's kernel is
    now computed inside the update's (a pointwise sibling), which stores the bf16 moment and nothing fp32."""
    m, v, g = (random_tensor((130, 64), torch.bfloat16, seed=seed) for seed in (20, 21, 22))
    v = v.abs()
    _, result = _fused(_adam_like_moments, m, v, g)
    stored = {store.buffer.name: store.buffer.dtype for kernel in result.kernels for store in kinds.stores(kernel)}
    assert len(result.kernels) == 1 and "float32" not in stored.values()
    assert any("inside" in decision and decision.endswith(": fused") for decision in result.decisions)
    check_against_eager(_adam_like_moments, m, v, g)


def test_a_pointwise_kernel_read_by_a_later_one_is_computed_inside_it():
    """Two pointwise groups over one domain, the later reading the earlier's output with its own index map: one
    kernel, the earlier output stored only because the graph returns it; its reader gets the value on chip."""
    x, y = random_tensor((129, 300), seed=30), random_tensor((129, 300), seed=31)

    def fn(x, y):
        a = x * 2 + y  # the first group
        b = (y - 1) * x  # the second group: joins neither a's group nor a alone
        return a, b * a.exp()

    lowered, result = _fused(fn, x, y)
    assert len(result.kernels) == 1
    stored = [store.buffer.name for store in kinds.stores(result.kernels[0])]
    assert sorted(stored) == sorted(value.buffer for value in lowered.outputs)
    assert not {load.buffer for load in kinds.loads(result.kernels[0])} & set(stored)  # nothing read back
    check_against_eager(fn, x, y)


def test_a_pointwise_kernel_read_through_another_view_keeps_its_own_kernel():
    """Read transposed, the earlier kernel's values are not the later one's elements: no pairing."""
    x, y = random_tensor((64, 64), seed=32), random_tensor((64, 64), seed=33)

    def fn(x, y):
        a = x * 2 + y
        return (y - 1) * x * a.t().exp()

    _, result = _fused(fn, x, y)
    assert len(result.kernels) == 2
    assert any("index map" in decision for decision in result.decisions if " inside " in decision)
    check_against_eager(fn, x, y)


def test_a_reader_that_would_not_fit_keeps_the_cheap_nodes_it_reads():
    """A cheap node is inlined only where its reader still fits the target; otherwise both stay as they were
    (an argmax over a flat 2700-element row took more tiles than SBUF holds once its inputs were inlined)."""
    a, b = random_tensor((2, 130, 64), torch.bfloat16, seed=10), random_tensor((2, 130, 64), torch.bfloat16, seed=11)
    weight = random_tensor((64,), torch.bfloat16, seed=12)
    lowered = lower_graph(trace(_llama_rms_norm, a, b, weight))
    outputs = {value.buffer for value in lowered.outputs}
    rejected = []

    def fits(node):
        rejected.append(node)
        return not isinstance(node, ir.Reduction)  # as if the norm were over the budget once inlined

    kept = inline_cheap(lowered.nodes, outputs, fits=fits)
    assert any(isinstance(node, ir.Reduction) for node in rejected)
    norm = next(node for node in kept if isinstance(node, ir.Reduction))
    original = next(node for node in lowered.nodes if isinstance(node, ir.Reduction))
    assert norm == original  # its loads untouched: the fp32 copies it reads are still written
    written = {store.buffer.name for node in kept for store in kinds.stores(node)}
    assert {load.buffer for load in kinds.loads(norm)} <= written | {buffer.name for buffer in lowered.inputs}
    assert inline_cheap(lowered.nodes, outputs, fits=lambda node: True) != lowered.nodes  # it would inline otherwise


def _gated_mlp(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


def _gated_mlp_inputs(rows=130, hidden=96, inner=200, dtype=torch.float32):
    return (random_tensor((rows, hidden), dtype, seed=1), random_tensor((inner, hidden), dtype, seed=2, low=-0.2, high=0.2),
            random_tensor((inner, hidden), dtype, seed=3, low=-0.2, high=0.2),
            random_tensor((hidden, inner), dtype, seed=4, low=-0.2, high=0.2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_and_up_projections_share_one_paired_matmul(dtype):
    """The gate is computed inside the up projection's kernel (one pass over x, the gate never stored)."""
    inputs = _gated_mlp_inputs(dtype=dtype)
    lowered = lower_graph(trace(_gated_mlp, *inputs))
    result = fuse(lowered.nodes, {value.buffer for value in lowered.outputs}, target=get_target("trn2"))
    paired = [kernel for kernel in result.kernels if isinstance(kernel, ir.MatMul) and kernel.b2 is not None]
    assert len(result.kernels) == 2 and len(paired) == 1
    assert any(" inside " in decision and decision.endswith("fused") for decision in result.decisions)
    assert any(ir.uses_result(store.expr) and "result1" in str(store.expr) for store in paired[0].stores)
    check_against_eager(_gated_mlp, *inputs, fp32_reference=dtype == torch.bfloat16)


def test_projections_needed_elsewhere_are_not_paired_and_say_why():
    def gate_also_returned(x, gate, up, down):
        gated, upped = x @ gate.t(), x @ up.t()
        return (torch.nn.functional.silu(gated) * upped) @ down.t(), gated, upped

    inputs = _gated_mlp_inputs(rows=40)
    lowered = lower_graph(trace(gate_also_returned, *inputs))
    result = fuse(lowered.nodes, {value.buffer for value in lowered.outputs}, target=get_target("trn2"))
    assert not any(isinstance(kernel, ir.MatMul) and kernel.b2 is not None for kernel in result.kernels)
    assert any("are needed outside" in decision for decision in result.decisions)
    check_against_eager(gate_also_returned, *inputs)


def test_without_a_dma_transpose_the_projections_stay_apart():
    """trn1 has no DMA transpose, which the paired form needs: the pair is refused, the result still right."""
    inputs = _gated_mlp_inputs(rows=40)
    lowered = lower_graph(trace(_gated_mlp, *inputs))
    result = fuse(lowered.nodes, {value.buffer for value in lowered.outputs}, target=get_target("trn1"))
    assert not any(isinstance(kernel, ir.MatMul) and kernel.b2 is not None for kernel in result.kernels)
    assert any("would not fit" in decision for decision in result.decisions)
    with config.patch(target="trn1"):
        check_against_eager(_gated_mlp, *inputs)


def _key_value_projections(x, wk, wv):
    return x @ wk.t(), x @ wv.t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_independent_projections_of_one_input_share_a_kernel(dtype):
    """Attention's k and v projections: both outputs are stored, from one pass over x."""
    x, wk, wv, _ = _gated_mlp_inputs(rows=130, hidden=96, inner=64, dtype=dtype)
    lowered = lower_graph(trace(_key_value_projections, x, wk, wv))
    result = fuse(lowered.nodes, {value.buffer for value in lowered.outputs}, target=get_target("trn2"))
    (paired,) = result.kernels
    assert isinstance(paired, ir.MatMul) and paired.b2 is not None and len(paired.stores) == 2
    check_against_eager(_key_value_projections, x, wk, wv)


def test_a_reader_between_two_projections_keeps_them_apart():
    def key_sum_then_value(x, wk, wv):
        k = x @ wk.t()
        return k, x @ wv.t() + k.sum(-1, keepdim=True)  # the sum of k is read by v's epilogue

    x, wk, wv, _ = _gated_mlp_inputs(rows=40, hidden=96, inner=64)
    lowered = lower_graph(trace(key_sum_then_value, x, wk, wv))
    result = fuse(lowered.nodes, {value.buffer for value in lowered.outputs}, target=get_target("trn2"))
    assert not any(isinstance(kernel, ir.MatMul) and kernel.b2 is not None for kernel in result.kernels)
    assert any("a kernel between them reads" in decision for decision in result.decisions)
    check_against_eager(key_sum_then_value, x, wk, wv)


def test_a_training_norm_at_hidden_2048_is_one_kernel_by_the_tiles_it_declares():
    """A training forward's RMSNorm at hidden 2048 (bf16, its rsqrt returned for the backward): the norm's row
    epilogue fused into the mean's kernel once needed 20 rows of 2048 fp32 per partition, over the SBUF budget, and
    the whole region fell back to eager; then the fusion refused the merge by the row budget's count of such rows.
    The tiles the kernel declares (kinds/reduction.py ``whole_row_bytes``) take a sixth of the budget: one kernel,
    which matches eager on the simulator (whose SBUF capacity check it passes). A target too small for a fused row
    epilogue keeps it apart: tests/test_residual_after_norm.py."""

    def norm(x, weight):
        widened = x.float()
        inverse_rms = torch.rsqrt(widened.pow(2).mean(-1, keepdim=True) + 1e-6)
        return weight * (widened * inverse_rms).to(torch.bfloat16), inverse_rms

    x = random_tensor((1, 256, 2048), torch.bfloat16, seed=1)
    weight = random_tensor((2048,), torch.bfloat16, seed=2)
    lowered = lower_graph(trace(norm, x, weight))
    result = fuse(lowered.nodes, {value.buffer for value in lowered.outputs}, target=get_target())
    assert len(result.kernels) == 1
    assert not any(decision.endswith("would not fit the target's SBUF") for decision in result.decisions)
    region = check_against_eager(norm, x, weight)
    assert len(region.kernels) == 1
