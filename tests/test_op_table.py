"""The expression op table: the IR accepts only its ops, codegen renders every entry from it (and has an entry for
every emitter), the lowerings build only its ops, and the range-guard pass and the simulator agree with its
valid input ranges."""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest

from neuron_compile import guarded_math, ir, op_table
from neuron_compile.codegen import expressions
from neuron_compile.codegen.expressions import AccessPattern, Ref, TileAllocator, TileScope
from neuron_compile.passes import activation_ranges
from neuron_compile.runtime.simulator.isa import ACTIVATION_RANGES

PACKAGE = Path(ir.__file__).parent
LAYOUT = ir.Layout((4, 16), (16, 1), 0)


# ---------------------------------------------------------------- the IR accepts only the table's ops


def test_an_unknown_op_is_rejected_with_its_name():
    x = ir.Load("x", LAYOUT, "float32")
    with pytest.raises(op_table.OpTableError, match="'frobnicate'"):
        ir.Op("frobnicate", (x,))
    with pytest.raises(op_table.OpTableError, match="'frobnicate'"):
        ir.op("frobnicate", x, 1.0)
    with pytest.raises(op_table.OpTableError, match="'exp' takes 1 operands, got 2"):
        ir.op("exp", x, x)
    assert ir.op("exp", x).op == "exp"


def test_the_table_is_consistent():
    arity = {"binary": 2, "tensor_scalar": 1, "activation": 1, "copy": 1}
    for name, entry in op_table.OPS.items():
        assert entry.name == name and entry.form in op_table.FORMS and entry.cost in op_table.COST_CLASSES, name
        assert entry.form == "sequence" or entry.arity == arity[entry.form], name
        assert (entry.nl_op is not None) == (entry.form in ("binary", "activation")), name
        assert (entry.cost == "scalar") == (entry.form == "activation"), name
        if entry.in_range_form is not None:  # a range-limited function and its bare instruction: one range
            bare = op_table.OPS[entry.in_range_form]
            assert entry.valid_range is not None and bare.valid_range == entry.valid_range, name
            assert bare.nl_op == entry.nl_op and bare.in_range_form is None, name


def _lowering_op_names() -> dict[str, str]:
    """Every op name written as a literal where the compiler builds expressions: the first argument of ``ir.op``,
    ``ir.Op`` and the lowerings' own builders (``_op``, ``op``, ``_compare``), and the op names of the lowerings'
    ATen -> op tables (``UNARY``, ``BINARY``)."""
    found = {}
    for path in [*PACKAGE.glob("lowering/*.py"), *PACKAGE.glob("passes/*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if function in ("op", "Op", "_op", "_compare") and isinstance(node.args[0].value, str):
                    found[node.args[0].value] = path.name
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") in ("UNARY", "BINARY") for t in node.targets):
                for value in node.value.values:
                    if isinstance(value, ast.Constant):
                        found[value.value] = path.name
    return found


def test_every_op_a_lowering_builds_is_in_the_table():
    found = _lowering_op_names()
    assert len(found) > 30  # the scan sees the lowerings' ops (a broken scan would pass vacuously)
    unknown = {name: where for name, where in found.items() if name not in op_table.OPS}
    assert not unknown, unknown


# ---------------------------------------------------------------- codegen renders every entry from the table


def _scope() -> TileScope:
    def load_pattern(load, tile):
        return f"{tile}[0:rows, 0:cols]", AccessPattern(load.buffer, ((16, "rows"), (1, "cols")), "p0 * 16 + f0")

    return TileScope(TileAllocator(4), 16, "[0:rows, 0:cols]", load_pattern)


def _operand_cases(arity: int):
    """Operand kinds: an fp32 tile, a bf16 tile, a number, a (P, 1) row vector; the mixes codegen meets (no constant
    condition)."""
    kinds = {1: [("tile",), ("bf16",), ("vector",)],
             2: [("tile", "tile"), ("tile", "number"), ("number", "tile"), ("tile", "vector"), ("vector", "tile"),
                 ("vector", "vector"), ("vector", "number"), ("bf16", "tile"), ("tile", "bf16")],
             3: [("tile", "tile", "tile"), ("tile", "number", "tile"), ("tile", "tile", "number"),
                 ("vector", "vector", "number"), ("tile", "vector", "bf16"), ("bf16", "tile", "vector")]}
    return kinds[arity]


def _render(name: str, case) -> tuple[list[str], TileScope]:
    scope, lines = _scope(), []
    refs = []
    for i, kind in enumerate(case):
        if kind == "number":
            refs.append(Ref(value=2.0 + i))
        else:
            dtype = "bfloat16" if kind == "bf16" else "float32"
            tile = scope.tile(dtype, stem=f"operand{i}", vector=kind == "vector")
            refs.append(Ref(tile=tile, dtype=dtype, vector=kind == "vector"))
    expr = ir.Op(name, tuple(ir.Scalar(1.0) for _ in case), dtype="bfloat16" if name == "cast" else None)
    expressions._emit_op(expr, refs, scope, lines)
    return lines, scope


@pytest.mark.parametrize("name", sorted(op_table.OPS))
def test_every_table_entry_renders_to_its_instructions(name):
    entry = op_table.OPS[name]
    for case in _operand_cases(entry.arity):
        lines, _ = _render(name, case)
        if name == "cast" and case == ("bf16",):
            assert lines == []  # a bf16 tile cast to bf16 is the tile itself
            continue
        called = set(re.findall(r"nisa\.(\w+)\(", "\n".join(lines)))
        assert lines and called <= set(entry.instructions), (case, called - set(entry.instructions))
        if entry.form == "activation":
            assert f"op={entry.nl_op}," in lines[-1], lines
        if entry.form == "binary" and "number" not in case and "vector" not in case:
            expected = (f"nisa.tensor_tensor(dst={name}_3[0:rows, 0:cols], data1=operand0_1[0:rows, 0:cols], "
                        f"data2=operand1_2[0:rows, 0:cols], op={entry.nl_op})")
            assert lines == [expected]


def test_every_emitter_has_a_table_entry_and_every_form_an_emitter():
    sequences = {name for name, entry in op_table.OPS.items() if entry.form == "sequence"}
    assert set(expressions.SEQUENCES) == sequences
    assert set(expressions.PLAIN_FORMS) | {"copy", "sequence"} == set(op_table.FORMS)


def test_number_first_operands_render_from_the_table():
    lines, _ = _render("lt", ("number", "tile"))  # 2 < x is x > 2
    assert lines == [("nisa.tensor_scalar(dst=lt_2[0:rows, 0:cols], data=operand1_1[0:rows, 0:cols], "
                      "op0=nl.greater, operand0=2.0)")]
    lines, _ = _render("sub", ("number", "tile"))  # 2 - x is x * -1 + 2
    assert lines == [("nisa.tensor_scalar(dst=sub_2[0:rows, 0:cols], data=operand1_1[0:rows, 0:cols], "
                      "op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=2.0)")]
    assert expressions._emit_op(ir.op("maximum", 1.0, 3.0), [Ref(value=1.0), Ref(value=3.0)], _scope(), []) == \
        Ref(value=3.0)  # folded by the table's fold


# ---------------------------------------------------------------- tiles: named for what they hold, none unused


def test_tiles_are_named_for_what_they_hold_and_every_one_is_used():
    x = ir.Load("x", LAYOUT, "float32")
    s = ir.Load("s", ir.Layout((4, 16), (1, 0), 0), "bfloat16")  # constant along the free axis
    expr = ir.Op("cast", (ir.op("where", ir.op("gt", x, 0.0), ir.op("exp", x), ir.op("mul", x, s)),), "bfloat16")

    def vector_pattern(load, tile):
        return None if load.buffer == "x" else (f"{tile}[0:rows, 0:1]", f"{load.buffer}.ap([[1, rows], [0, 1]])")

    scope = _scope()
    scope.vector_pattern = vector_pattern
    lines: list[str] = []
    expressions.emit(expr, scope, lines)
    declared = [line.split(" = ")[0] for line in scope.allocator.lines]
    assert declared[:4] == ["x_tile_1", "gt_2", "exp_3", "s_column_4"]
    assert "as_bfloat16" in declared[-1] and {"mul_5", "where_6", "predicate_7"} <= set(declared)
    assert len(set(declared)) == len(declared) and all(name.isidentifier() for name in declared)
    body = "\n".join(lines)
    for name in declared:  # no tile is allocated and left unused (a load of x used to leave a (P, 1) tile)
        assert re.search(rf"\b{name}\[", body), name


def test_iota_restates_the_load_access_pattern():
    scope, lines = _scope(), []
    ref = expressions.emit(ir.Iota(LAYOUT), scope, lines)
    assert ref.tile == "iota_1" and ref.dtype == "int32"
    assert lines == ["nisa.iota(iota_1[0:rows, 0:cols], [[1, cols]], offset=p0 * 16 + f0, channel_multiplier=16)"]
    pattern = AccessPattern("x", ((16, "rows"), (1, "cols")), "p0 * 16")
    assert str(pattern) == "x.ap([[16, rows], [1, cols]], offset=p0 * 16)"


# ---------------------------------------------------------------- valid ranges: the pass and the simulator


def test_the_range_guard_pass_guards_the_tables_range_limited_functions():
    limited = {name for name, entry in op_table.OPS.items() if entry.in_range_form is not None}
    assert set(guarded_math.GUARDED) == limited == set(guarded_math.EXPANSIONS)
    x = ir.Load("x", LAYOUT, "float32")
    # without a floor, these take ALU instructions that have no valid range
    unranged = {"reciprocal": "reciprocal_alu", "sqrt": "sqrt_alu", "rsqrt": "rsqrt_alu"}
    for name in limited:
        text = str(activation_ranges.guard_expression(ir.op(name, x)))
        instruction = unranged.get(name, op_table.OPS[name].in_range_form)
        assert f"{instruction}(" in text and f" {name}(" not in f" {text}", name
    assert all(op_table.OPS[name].valid_range is None for name in ("reciprocal_alu", "rsqrt_alu", "sqrt_alu"))


def test_the_range_guard_pass_checks_its_scalings_against_the_tables_ranges(monkeypatch):
    guarded_math.check_scalings()  # the table as it is: every scaled input is inside its range
    for name, narrow in [("log_in_range", (2.0**-40, 2.0**64)), ("sqrt_in_range", (2.0**-116, 2.0**60))]:
        spec = op_table.OPS[name]
        valid = dataclasses.replace(spec.valid_range, low=narrow[0], high=narrow[1])
        monkeypatch.setitem(op_table.OPS, name, dataclasses.replace(spec, valid_range=valid))
        with pytest.raises(guarded_math.RangeGuardError, match=name):
            guarded_math.check_scalings()
        monkeypatch.setitem(op_table.OPS, name, spec)


@pytest.mark.parametrize("name", sorted(n for n, e in op_table.OPS.items() if e.valid_range is not None))
def test_the_tables_ranges_are_the_simulators(name):
    entry = op_table.OPS[name]
    function = entry.nl_op.removeprefix("nl.")
    _, valid = ACTIVATION_RANGES[function]
    low, high = entry.valid_range.low, entry.valid_range.high
    inside = [low, high, math.sqrt(low * high) if low > 0 else 0.5 * (low + high)]
    outside = [low * 0.99 if low > 0 else low * 1.01, high * 1.01]
    if entry.valid_range.magnitude:
        inside += [-value for value in inside]
        outside += [-value for value in outside]
    assert valid(np.array(inside, dtype=np.float32)).all(), inside
    assert not valid(np.array(outside, dtype=np.float32)).any(), outside
    assert all(entry.valid_range.contains(v) for v in inside)
    assert not any(entry.valid_range.contains(v) for v in outside)


def test_alu_rsqrt_of_a_psum_tile_reads_an_sbuf_copy():
    """GpSimd cannot reach PSUM: the rsqrt of a matmul's PSUM tile reads an SBUF copy of it."""
    scope, lines = _scope(), []
    psum = scope.allocator.new_psum("product", 16)
    expressions._emit_op(ir.Op("rsqrt_alu", (ir.Scalar(1.0),)), [Ref(tile=psum)], scope, lines)
    assert lines[0].startswith("nisa.tensor_copy(") and f"src={psum}[0:rows, 0:cols]" in lines[0]
    assert "op0=nl.rsqrt" in lines[1] and "engine=nisa.engine.gpsimd" in lines[1] and psum not in lines[1]


def test_alu_sqrt_is_one_rsqrt_and_one_multiply_and_reads_psum_through_an_sbuf_copy():
    """sqrt(x) = x * min(|rsqrt(min(x, fp32 max))|, 2**100): two instructions, the first on GpSimd, which cannot
    reach PSUM (a matmul's PSUM tile is copied to SBUF for it)."""
    scope, lines = _scope(), []
    psum = scope.allocator.new_psum("product", 16)
    expressions._emit_op(ir.Op("sqrt_alu", (ir.Scalar(1.0),)), [Ref(tile=psum)], scope, lines)
    assert lines[0].startswith("nisa.tensor_copy(") and f"src={psum}[0:rows, 0:cols]" in lines[0]
    assert "op0=nl.minimum" in lines[1] and "op1=nl.rsqrt" in lines[1] and "engine=nisa.engine.gpsimd" in lines[1]
    assert lines[2].startswith("nisa.scalar_tensor_tensor(") and "op0=nl.abs_min" in lines[2]
    assert len(lines) == 3 and all(psum not in line for line in lines[1:])


def test_a_rounded_alu_sqrt_writes_the_narrow_tile_itself():
    """cast[bf16](sqrt_alu(x)): the multiply rounds its fp32 product into the bf16 tile, as the cast would."""
    scope, lines = _scope(), []
    x = ir.Load("x", LAYOUT, "float32")
    rounded = expressions.emit(ir.Op("cast", (ir.Op("sqrt_alu", (x,)),), dtype="bfloat16"), scope, lines)
    assert rounded.dtype == "bfloat16" and not any(line.startswith("nisa.tensor_copy(") for line in lines)
    assert lines[-1].startswith("nisa.scalar_tensor_tensor(") and lines[-1].startswith(
        f"nisa.scalar_tensor_tensor(dst={scope.ref_text(rounded)},")


def test_number_casts_fold_and_a_multiply_by_one_is_no_instruction():
    """cast[bf16](0.1) is the number a memset would store (no full-tile memset and multiply); x * 1.0 is x."""
    scope, lines = _scope(), []
    tile = Ref(tile=scope.tile(stem="x"))
    rounded = expressions._emit_op(ir.Op("cast", (ir.Scalar(0.1),), dtype="bfloat16"), [Ref(value=0.1)], scope, lines)
    assert lines == [] and rounded.value == float(np.float32(0.1).astype("bfloat16"))
    huge = expressions._emit_op(ir.Op("cast", (ir.Scalar(1e39),), dtype="float32"), [Ref(value=1e39)], scope, lines)
    assert huge.value == math.inf
    product = expressions._emit_op(ir.Op("mul", (ir.Scalar(1.0), ir.Scalar(1.0))), [tile, Ref(value=1.0)], scope,
                                   lines)
    assert lines == [] and product == tile
