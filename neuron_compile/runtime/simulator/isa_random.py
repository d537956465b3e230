"""Simulator stage: the random-number instructions of ``nki.isa`` (set_rng_seed, rand_set_state, rand_get_state,
rng, rand2, dropout).

Input: SBUF/PSUM tiles (seeds, states, data) and instruction attributes. Output: dst written, the engine's PRNG
state kept in the kernel context (memory.KernelContext.random_states), every rule of the NKI API checked
(NkiValidationError naming the rule, the values and the instruction), one InstructionRecord per instruction.

The generator. The hardware runs XORWOW per compute lane; its exact stream is not published (and eager's stream
cannot be matched anyway), so the simulator keeps the API's state shape with a counter-based generator: each lane
of an engine holds a state of uint32 words (6 on GpSimd, 24 on VectorE: the element counts rand_set_state and
rand_get_state take). Words 2 and 3 are a 64-bit counter, the others the key; the i-th value a lane draws is the
high half of SplitMix64's output ``mix64(hash(key) + (counter + i) * gamma)``, and an instruction of F elements
per partition draws F values per lane in element order and advances its counter by F. The lane is the physical
partition. So a value depends only on the lane's seed and on how much that lane drew before: runs repeat
exactly, threads do not interfere, and a kernel that re-seeds before each tile gets values that depend only on
the seed and the tile, not on the order its loops visit tiles.

* ``set_rng_seed(s)`` seeds every VectorE lane with words ``[s, lane, 0, ...]`` (lanes differ);
  ``rand_set_state`` writes each partition's words verbatim into its lane (equal seeds give equal streams, as
  the API gives each lane its own seed); ``rand_get_state`` reads them back, so get then set resumes a stream.
* Drawing on an engine that no instruction of this kernel seeded raises ``err_rng_not_seeded``: on hardware the
  state is whatever an earlier NEFF left, so such a kernel is not reproducible.
* Uniform floats take the top 24 bits: ``u = (bits >> 8) * 2**-24`` in [0, 1). ``dropout`` keeps an element
  where ``u >= prob`` (prob 0 keeps every element, 1 drops every one) and writes 0 elsewhere, unscaled;
  ``rand2`` gives ``min + u * (max - min)``; ``rng`` writes the low bits of each 32-bit value.
"""

from __future__ import annotations

import numpy as np

from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.memory import current
from neuron_compile.runtime.simulator.rules import (
    FLOAT32,
    check_elementwise,
    check_no_psum_on_gpsimd,
    check_tile,
    engine_name,
    is_float,
    record,
    require_buffers,
    require_version,
    require_tensor,
    scalar_or_vector,
    store,
)

STATE_WORDS = {"gpsimd": 6, "vector": 24}  # uint32 words of one lane's XORWOW state, per engine
COUNTER_WORDS = (2, 3)  # low and high half of the lane's 64-bit counter
LANES = 128
GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment (the golden ratio)
MIX1, MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
UNIFORM_BITS = 24  # bits of a uniform float in [0, 1): exact in fp32
RNG_DTYPES = {"int8", "int16", "int32", "uint8", "uint16", "uint32"}
RAND2_DTYPES = RNG_DTYPES | {"float8_e4m3", "float8_e5m2", "float16", "bfloat16", "float32", "tfloat32"}


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    return z ^ (z >> np.uint64(31))


def lane_keys(words: np.ndarray) -> np.ndarray:
    """One uint64 key per lane from the state words that are not the counter."""
    key = np.zeros(words.shape[0], dtype=np.uint64)
    for column in range(words.shape[1]):
        if column not in COUNTER_WORDS:
            key = mix64((key ^ words[:, column].astype(np.uint64)) + GAMMA)
    return key


def draw_bits(op: str, engine: str, first_lane: int, partitions: int, count: int) -> np.ndarray:
    """(partitions, count) uint32 values from lanes first_lane.., advancing each lane's counter by count."""
    states = current().random_states.get(engine)
    if states is None:
        raise NkiValidationError(
            "err_rng_not_seeded",
            f"the {engine} engine's random-number generator was not seeded in this kernel (nisa.set_rng_seed, or "
            "nisa.rand_set_state): its state would be whatever an earlier program left", op,
        )
    lanes = states[first_lane:first_lane + partitions]
    low, high = COUNTER_WORDS
    counter = lanes[:, low].astype(np.uint64) | (lanes[:, high].astype(np.uint64) << np.uint64(32))
    steps = counter[:, None] + np.arange(count, dtype=np.uint64)[None, :]
    bits = (mix64(lane_keys(lanes)[:, None] + steps * GAMMA) >> np.uint64(32)).astype(np.uint32)
    counter = counter + np.uint64(count)
    lanes[:, low] = (counter & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    lanes[:, high] = (counter >> np.uint64(32)).astype(np.uint32)
    return bits


def uniform(bits: np.ndarray) -> np.ndarray:
    """fp32 values in [0, 1) from the top UNIFORM_BITS of 32-bit values."""
    return (bits >> np.uint32(32 - UNIFORM_BITS)).astype(FLOAT32) * np.float32(2.0**-UNIFORM_BITS)


def _state_engine(op: str, engine) -> str:
    """rand_set_state / rand_get_state: GpSimd, or VectorE from NeuronCore-v4 (gen4) on."""
    require_version(op, "gen3")
    eng = engine_name(engine, "gpsimd")
    if eng not in STATE_WORDS:
        raise NkiValidationError("err_rng_engine", f"engine {eng}: the PRNG state lives on gpsimd or vector", op)
    if eng == "vector":
        require_version(op, "gen4", "the Vector engine's PRNG state")
    return eng


def _check_state_tile(op: str, role: str, tile, eng: str) -> None:
    check_tile(op, role, tile)
    if tile.dtype.name != "uint32":
        raise NkiValidationError("err_rng_state_dtype", f"{role} {tile.name} must be uint32, got {tile.dtype.name}",
                                 op)
    if tile.free_size != STATE_WORDS[eng]:
        raise NkiValidationError(
            "err_rng_state_shape", f"{role} {tile.name} {tile.shape} has {tile.free_size} elements per partition; "
            f"a {eng} lane's XORWOW state is {STATE_WORDS[eng]} uint32 words", op,
        )


def _engine_states(eng: str) -> np.ndarray:
    states = current().random_states
    if eng not in states:
        states[eng] = np.zeros((LANES, STATE_WORDS[eng]), dtype=np.uint32)
    return states[eng]


def set_rng_seed(src_seeds, name=None):
    """Seed every VectorE lane from one 32-bit value in a [1, 1] SBUF/PSUM tile (lanes get distinct streams)."""
    op = "set_rng_seed"
    src = require_tensor(op, "src_seeds", src_seeds)
    require_buffers(op, "src_seeds", src, ("sbuf", "psum"))
    check_tile(op, "src_seeds", src)
    if src.shape != (1, 1):
        raise NkiValidationError("err_rng_seed_shape", f"src_seeds {src.name} is {src.shape}, must be [1, 1]", op)
    if src.dtype.itemsize != 4:
        raise NkiValidationError(
            "err_rng_seed_dtype", f"src_seeds {src.name} is {src.dtype.name}; the seed must be a 32-bit value", op
        )
    seed = np.ascontiguousarray(src.read()).reshape(-1).view(np.uint32)[0]
    current().random_states["vector"] = words = np.zeros((LANES, STATE_WORDS["vector"]), dtype=np.uint32)
    words[:, 0] = seed
    words[:, 1] = np.arange(LANES, dtype=np.uint32)
    record(op, "vector", None, [("src_seeds", src)])


def rand_set_state(src_seeds, engine=None, name=None):
    """Write each partition's uint32 state words into the PRNG lane of the same partition."""
    op = "rand_set_state"
    src = require_tensor(op, "src_seeds", src_seeds)
    eng = _state_engine(op, engine)
    require_buffers(op, "src_seeds", src, ("sbuf",))
    _check_state_tile(op, "src_seeds", src, eng)
    first = src.start_partition
    _engine_states(eng)[first:first + src.partitions] = src.read().reshape(src.partitions, -1)
    record(op, eng, None, [("src_seeds", src)])


def rand_get_state(dst, engine=None, name=None):
    """Read each lane's uint32 state words into the partition of the same index."""
    op = "rand_get_state"
    dst = require_tensor(op, "dst", dst)
    eng = _state_engine(op, engine)
    require_buffers(op, "dst", dst, ("sbuf", "psum") if current().target.nc_version >= "gen4" else ("sbuf",))
    check_no_psum_on_gpsimd(op, eng, ("dst", dst))
    _check_state_tile(op, "dst", dst, eng)
    states = current().random_states.get(eng)
    if states is None:
        raise NkiValidationError("err_rng_not_seeded", f"the {eng} engine's PRNG was not seeded in this kernel", op)
    store(dst, states[dst.start_partition:dst.start_partition + dst.partitions])
    record(op, eng, dst, [])


def rng(dst, engine=None, name=None):
    """32 random bits per element, truncated to dst's integer dtype (its least significant bits)."""
    op = "rng"
    dst = require_tensor(op, "dst", dst)
    eng = engine_name(engine, "vector")
    if eng not in ("vector", "gpsimd"):
        raise NkiValidationError("err_rng_engine", f"engine {eng}: rng runs on vector or gpsimd", op)
    if eng == "gpsimd":
        require_version(op, "gen3", "rng on the GpSimd engine")
    require_buffers(op, "dst", dst, ("sbuf", "psum"))
    check_tile(op, "dst", dst)
    check_no_psum_on_gpsimd(op, eng, ("dst", dst))
    if dst.dtype.name not in RNG_DTYPES:
        raise NkiValidationError(
            "err_rng_dst_dtype", f"dst {dst.name} is {dst.dtype.name}; rng writes {sorted(RNG_DTYPES)}", op
        )
    bits = draw_bits(op, eng, dst.start_partition, dst.partitions, dst.free_size)
    unsigned = np.dtype(f"uint{dst.dtype.itemsize * 8}")
    store(dst, bits.astype(unsigned).view(dst.dtype))  # the truncation keeps the low bits
    record(op, eng, dst, [])


def rand2(dst, min, max, name=None):  # noqa: A002 - the API's parameter names
    """Uniform values in [min, max) (fp32, rounded to dst's dtype) on VectorE; NeuronCore-v4 and newer."""
    op = "rand2"
    dst = require_tensor(op, "dst", dst)
    require_version(op, "gen4")
    require_buffers(op, "dst", dst, ("sbuf", "psum"))
    check_tile(op, "dst", dst)
    if dst.dtype.name not in RAND2_DTYPES:
        raise NkiValidationError(
            "err_rand2_dst_dtype", f"dst {dst.name} is {dst.dtype.name}; rand2 writes {sorted(RAND2_DTYPES)}", op
        )
    low = scalar_or_vector(op, "min", min, dst.partitions, "err_rand2_operand")
    high = scalar_or_vector(op, "max", max, dst.partitions, "err_rand2_operand")
    if not np.all(low < high):
        raise NkiValidationError("err_rand2_range", f"min must be below max, got min {low!r}, max {high!r}", op)
    u = uniform(draw_bits(op, "vector", dst.start_partition, dst.partitions, dst.free_size))
    store(dst, low + u * (high - low))
    record(op, "vector", dst, [("min", min), ("max", max)], flops=2 * dst.size)


def _drop_probability(op: str, prob, data) -> np.ndarray:
    """prob as fp32 (a scalar, or a (P, 1) column per partition), each within [0, 1]."""
    if hasattr(prob, "shape") and not is_float(data.dtype) and prob.dtype != FLOAT32:
        raise NkiValidationError(
            "err_dropout_prob_dtype", f"prob {prob.name} is {prob.dtype.name}; with integer data it must be float32",
            op,
        )
    values = scalar_or_vector(op, "prob", prob, data.partitions, "err_dropout_prob_shape", require_fp32=False)
    if not np.all((values >= 0) & (values <= 1)):
        raise NkiValidationError("err_dropout_prob_range", f"drop probability must lie in [0, 1], got {values!r}", op)
    return values


def dropout(dst, data, prob, name=None):
    """dst = data where a uniform draw is >= prob, else 0 (VectorE; prob a scalar or a (P, 1) tile; no scaling)."""
    op = "dropout"
    dst, data = require_tensor(op, "dst", dst), require_tensor(op, "data", data)
    check_elementwise(op, dst, [("data", data)], "vector")
    if dst.dtype != data.dtype:
        raise NkiValidationError(
            "err_dropout_dtype", f"dst {dst.name} is {dst.dtype.name}, data {data.name} is {data.dtype.name}: "
            "they must match", op,
        )
    drop = _drop_probability(op, prob, data)
    keep = uniform(draw_bits(op, "vector", dst.start_partition, dst.partitions, dst.free_size)) >= drop
    values = data.read().reshape(data.partitions, -1)
    store(dst, np.where(keep, values, np.zeros((), dtype=values.dtype)))
    record(op, "vector", dst, [("data", data), ("prob", prob)], {"prob": prob if np.isscalar(prob) else None},
           flops=dst.size)
