"""Whole kernels written the way the production NKI library writes them (accumulator registers, top-8 search and
replace, range selection, LNC=2 cores exchanging partial results), on the simulator against torch references."""

from __future__ import annotations

import numpy as np
import torch

from neuron_compile.runtime import simulator as nki

nl = nki.language
nisa = nki.isa
F32 = np.float32
FP32_MIN = -3.4028235e38


def _load(src, dtype=None):
    tile = nl.ndarray(src.shape, dtype or src.dtype)
    nisa.dma_copy(tile, src)
    return tile


def top_k_router(x, w, k):
    """Router: logits = x @ w on TensorE, softmax over experts (max, exp with a running sum, reciprocal), then the
    top k experts by repeated max8 and nc_match_replace8, 8 at a time."""
    tokens, hidden = x.shape
    experts = w.shape[1]
    x_t = nl.ndarray((hidden, tokens), x.dtype)
    nisa.dma_transpose(x_t, x)
    logits_psum = nl.ndarray((tokens, experts), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(logits_psum, x_t, _load(w))
    logits = nl.ndarray((tokens, experts), nl.float32)
    nisa.tensor_copy(logits, logits_psum)
    negative_max, total = nl.ndarray((tokens, 1), nl.float32), nl.ndarray((tokens, 1), nl.float32)
    nisa.tensor_reduce(negative_max, nl.maximum, logits, axis=1, negate=True)
    probabilities = nl.ndarray((tokens, experts), nl.float32)
    nisa.activation(probabilities, nl.exp, logits, bias=negative_max, reduce_op=nl.add, reduce_res=total,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    inverse = nl.ndarray((tokens, 1), nl.float32)
    nisa.reciprocal(inverse, total)
    nisa.tensor_scalar(probabilities, probabilities, nl.multiply, inverse)
    values, index = nl.ndarray((tokens, k), nl.float32), nl.ndarray((tokens, k), nl.uint32)
    searched = nl.ndarray((tokens, experts), nl.float32)
    nisa.tensor_copy(searched, probabilities)
    for first in range(0, k, 8):
        nisa.max8(values[:, first:first + 8], searched)
        nisa.nc_match_replace8(searched, searched, values[:, first:first + 8], FP32_MIN,
                               dst_idx=index[:, first:first + 8])
    out_values = nl.ndarray((tokens, k), nl.float32, buffer=nl.shared_hbm)
    out_index = nl.ndarray((tokens, k), nl.uint32, buffer=nl.shared_hbm)
    nisa.dma_copy(out_values, values)
    nisa.dma_copy(out_index, index)
    return out_values, out_index


def test_top_k_router_matches_torch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 128)).astype(F32)
    w = rng.standard_normal((128, 96)).astype(F32) * 0.1
    values, index = nki.run_kernel(top_k_router, [x, w, 16]).outputs
    want = torch.softmax(torch.from_numpy(x) @ torch.from_numpy(w), dim=-1).topk(16, dim=-1)
    np.testing.assert_allclose(values, want.values.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(index, want.indices.numpy())


def cross_entropy_rows(logits, targets, chunk):
    """loss = logsumexp(row) - row[target], streaming the vocabulary in chunks: the running max and the running
    exp-sum are reduced per chunk on VectorE (tensor_scalar_reduce, exponential's running sum) and carried in SBUF,
    rescaled when the max grows; the target logit is picked by range_select with the window [target, target + 1)."""
    rows, vocab = logits.shape
    target = nl.ndarray((rows, 1), nl.float32)
    nisa.dma_copy(target, targets)
    target_end = nl.ndarray((rows, 1), nl.float32)
    nisa.tensor_scalar(target_end, target, nl.add, 1.0)
    running_max, running_sum = nl.full((rows, 1), FP32_MIN, nl.float32), nl.zeros((rows, 1), nl.float32)
    picked = nl.full((rows, 1), FP32_MIN, nl.float32)
    for start in range(0, vocab, chunk):
        tile = _load(logits[:, start:start + chunk])
        chunk_max, new_max = nl.ndarray((rows, 1), nl.float32), nl.ndarray((rows, 1), nl.float32)
        scratch = nl.ndarray((rows, chunk), nl.float32)
        nisa.tensor_scalar_reduce(scratch, tile, nl.add, 0.0, nl.maximum, chunk_max)
        nisa.tensor_tensor(new_max, running_max, chunk_max, nl.maximum)
        shift = nl.ndarray((rows, 1), nl.float32)
        nisa.tensor_tensor(shift, running_max, new_max, nl.subtract)
        nisa.activation(shift, nl.exp, shift)  # exp(old max - new max) rescales the running sum
        nisa.tensor_tensor(running_sum, running_sum, shift, nl.multiply)
        chunk_sum = nl.ndarray((rows, 1), nl.float32)
        nisa.exponential(scratch, tile, max_value=new_max, reduce_res=chunk_sum,
                         reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.tensor_tensor(running_sum, running_sum, chunk_sum, nl.add)
        nisa.tensor_copy(running_max, new_max)
        # the accumulator registers are shared by VectorE's accumulating instructions, so the target's logit is
        # kept per chunk and folded here, not left in the registers across the chunk's other instructions
        chunk_pick = nl.ndarray((rows, 1), nl.float32)
        nisa.range_select(scratch, tile, nl.greater_equal, nl.less, target, target_end, reduce_res=chunk_pick,
                          range_start=start)
        nisa.tensor_tensor(picked, picked, chunk_pick, nl.maximum)
    loss = nl.ndarray((rows, 1), nl.float32)
    nisa.activation(loss, nl.log, running_sum)
    nisa.tensor_tensor(loss, loss, running_max, nl.add)
    nisa.tensor_tensor(loss, loss, picked, nl.subtract)
    out = nl.ndarray((rows, 1), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(out, loss)
    return out


def test_streamed_cross_entropy_matches_torch():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((32, 1024)) * 4).astype(F32)
    targets = rng.integers(0, 1024, size=(32, 1)).astype(F32)
    loss = nki.run_kernel(cross_entropy_rows, [logits, targets, 256], target="trn3").outputs[0]
    want = torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(targets[:, 0]).long(),
                                             reduction="none")
    np.testing.assert_allclose(loss[:, 0], want.numpy(), rtol=1e-5, atol=1e-5)


def split_kv_decode(q, k_t, v):
    """One query row per partition attending over a KV cache split between the two cores of an LNC=2 pair: each
    core takes half of the keys, computes its partial max, exp-sum and weighted values, swaps them with the other
    core (sendrecv) and combines both halves; core 0 stores the result."""
    heads, head_dim = q.shape
    context = v.shape[0]
    me, half = nl.program_id(0), context // 2
    q_t = nl.ndarray((head_dim, heads), q.dtype)
    nisa.dma_transpose(q_t, q)
    keys = _load(k_t[:, me * half:(me + 1) * half])
    scores_psum = nl.ndarray((heads, half), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(scores_psum, q_t, keys)
    partial = nl.ndarray((heads, head_dim + 2), nl.float32)  # [weighted values | max | exp-sum]
    scores = nl.ndarray((heads, half), nl.float32)
    nisa.tensor_copy(scores, scores_psum)
    negative_max = nl.ndarray((heads, 1), nl.float32)
    nisa.tensor_reduce(negative_max, nl.maximum, scores, axis=1, negate=True)
    nisa.tensor_scalar(partial[:, head_dim:head_dim + 1], negative_max, nl.multiply, -1.0)
    weights = nl.ndarray((heads, half), nl.float32)
    nisa.activation(weights, nl.exp, scores, bias=negative_max, reduce_op=nl.add,
                    reduce_res=partial[:, head_dim + 1:head_dim + 2])
    weights_t_psum = nl.ndarray((half, heads), nl.float32, buffer=nl.psum)
    nisa.nc_transpose(weights_t_psum, weights)
    weights_t = nl.ndarray((half, heads), nl.float32)
    nisa.tensor_copy(weights_t, weights_t_psum)
    values_psum = nl.ndarray((heads, head_dim), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(values_psum, weights_t, _load(v[me * half:(me + 1) * half, :]))
    nisa.tensor_copy(partial[:, 0:head_dim], values_psum)
    other = nl.ndarray((heads, head_dim + 2), nl.float32)
    nisa.sendrecv(partial, other, send_to_rank=1 - me, recv_from_rank=1 - me, pipe_id=0)
    both_max = nl.ndarray((heads, 1), nl.float32)
    nisa.tensor_tensor(both_max, partial[:, head_dim:head_dim + 1], other[:, head_dim:head_dim + 1], nl.maximum)
    combined = nl.zeros((heads, head_dim + 2), nl.float32)
    for piece in (partial, other):
        factor = nl.ndarray((heads, 1), nl.float32)
        nisa.tensor_tensor(factor, piece[:, head_dim:head_dim + 1], both_max, nl.subtract)
        nisa.activation(factor, nl.exp, factor)
        nisa.scalar_tensor_tensor(combined, piece, nl.multiply, factor, nl.add, combined)
    inverse = nl.ndarray((heads, 1), nl.float32)
    nisa.reciprocal(inverse, combined[:, head_dim + 1:head_dim + 2])
    result = nl.ndarray((heads, head_dim), nl.float32)
    nisa.tensor_scalar(result, combined[:, 0:head_dim], nl.multiply, inverse)
    out = nl.ndarray((heads, head_dim), nl.float32, buffer=nl.shared_hbm)
    if me == 0:  # both cores hold the combined result; one stores it
        nisa.dma_copy(out, result)
    return out


def test_split_kv_decode_across_two_cores_matches_torch():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((16, 64)).astype(F32) * 0.3
    keys = rng.standard_normal((256, 64)).astype(F32)
    values = rng.standard_normal((256, 64)).astype(F32)
    run = nki.run_kernel(split_kv_decode, [q, np.ascontiguousarray(keys.T), values], lnc=2)
    want = torch.softmax(torch.from_numpy(q) @ torch.from_numpy(keys).T, dim=-1) @ torch.from_numpy(values)
    np.testing.assert_allclose(run.outputs[0], want.numpy(), rtol=2e-5, atol=2e-6)
    assert {r.program for r in run.trace if r.name == "sendrecv"} == {0, 1}
