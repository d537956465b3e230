"""The IR's expression walks (ir.nodes_of and what is built on it) on DAGs with shared subexpressions: each shared
node is visited once, the leaves come in order of first appearance, and a rebuild keeps the sharing. A tree walk
is exponential in the sharing depth: a Payne-Hanek reduction's kernels took seconds in ``loads_of`` alone."""

from __future__ import annotations

import time

from neuron_compile import ir

LAYOUT = ir.Layout((4, 8), (8, 1))


def load(name: str) -> ir.Load:
    return ir.Load(name, LAYOUT, "float32")


def doubling(depth: int, leaf: ir.Expr) -> ir.Expr:
    """``x = x + x`` ``depth`` times: ``depth`` Ops and one leaf, but 2**depth paths from the root to the leaf."""
    expr = leaf
    for _ in range(depth):
        expr = ir.op("add", expr, expr)
    return expr


def test_nodes_of_visits_each_shared_node_once():
    expr = doubling(200, load("x"))
    nodes = list(ir.nodes_of(expr))
    assert sum(isinstance(node, ir.Op) for node in nodes) == 200
    assert nodes[0] is expr and nodes[-1] == load("x")


def test_loads_of_a_deeply_shared_expression_is_fast_and_in_first_appearance_order():
    shared = doubling(22, load("b"))  # a tree walk: 4 million visits, seconds
    expr = ir.op("mul", ir.op("add", load("a"), shared), ir.op("sub", shared, load("c")))
    started = time.perf_counter()
    found = ir.loads_of(expr)
    assert time.perf_counter() - started < 1.0
    assert found == [load("a"), load("b"), load("c")]


def test_map_leaves_rebuilds_a_shared_subexpression_once():
    shared = ir.op("exp", load("x"))
    expr = ir.op("add", ir.op("mul", shared, ir.Result()), shared)
    rebuilt = ir.map_leaves(expr, lambda leaf: load("y") if isinstance(leaf, ir.Load) else leaf)
    assert rebuilt == ir.op("add", ir.op("mul", ir.op("exp", load("y")), ir.Result()), ir.op("exp", load("y")))
    assert rebuilt.args[0].args[0] is rebuilt.args[1]  # still one node, as in the original
    assert ir.map_leaves(ir.Scalar(2.0), lambda leaf: load("y")) == ir.Scalar(2.0)


def test_leaf_queries_see_leaves_below_shared_nodes():
    iota = ir.Iota(ir.Layout((4, 8), (1, 4), 3))
    keep = ir.RandomKeep(load("seed"), LAYOUT, 0.5)
    shared = ir.op("add", iota, ir.Result())
    expr = ir.op("mul", shared, ir.op("add", shared, keep))
    assert ir.uses_result(expr) and ir.draws_random(expr)
    assert not ir.uses_result(load("x")) and not ir.draws_random(shared)
    assert ir.access_layouts(expr) == [iota.layout, LAYOUT]
    assert ir.loads_of(expr) == [load("seed")]


def test_equal_copies_of_a_subexpression_count_once():
    # each level adds a node to a distinct copy of itself (equal, not the same object): by identity a walk would
    # still meet 2**200 paths; equal nodes are one
    expr = ir.op("exp", load("x"))
    for _ in range(200):
        expr = ir.op("add", expr, ir.Op(expr.op, expr.args, expr.dtype))
    assert sum(isinstance(node, ir.Op) for node in ir.nodes_of(expr)) == 201
    assert ir.loads_of(expr) == [load("x")]
