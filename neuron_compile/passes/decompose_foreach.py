"""Decomposition stage, foreach ops: ``aten._foreach_*`` (what ``torch.compile(optimizer.step)`` traces with
``foreach=True``) as one per-tensor ATen op per list element.

Input: nothing (a constant). Output: ``foreach_decompositions()``, entries for the decomposition table
(passes/decompose.py): each functional overload of ``aten._foreach_<op>`` maps to ``aten.<op>`` called once per
list index, list arguments (``Tensor[]``, ``Scalar[]``) taken element by element and the others passed whole
(``_foreach_add.List(xs, ys, alpha=a)`` is ``[aten.add(x, y, alpha=a) for x, y in zip(xs, ys)]``). The per-tensor
ops are ordinary pointwise nodes: fusion then merges each parameter's chain (AdamW's moments, bias correction and
update) into few kernels, as Inductor's foreach kernels do. ``_foreach_norm`` becomes ``linalg_vector_norm``
(gradient clipping). Overloads whose per-tensor form needs a different argument kind stay whole (and run
eagerly): ``addcmul`` / ``addcdiv`` with a tensor of scalars (``.Tensor``: the per-tensor op takes a number).
"""

from __future__ import annotations

import functools

import torch

aten = torch.ops.aten

# Base ops whose every functional foreach overload maps one to one onto the per-tensor op.
ELEMENTWISE = (
    "add", "sub", "mul", "div", "pow", "addcmul", "addcdiv", "lerp", "sqrt", "rsqrt", "neg", "reciprocal", "abs",
    "exp", "log", "sign", "sigmoid", "tanh", "copy", "zero", "clamp_min", "clamp_max", "max", "maximum",
)
KEPT_WHOLE = {"_foreach_addcmul.Tensor", "_foreach_addcdiv.Tensor"}


def _is_list(argument) -> bool:
    return isinstance(argument.type, torch.ListType)


def per_element(per_tensor, overload):
    """The decomposition of one foreach overload onto ``per_tensor`` (an op or packet called per list index)."""
    positions = [index for index, argument in enumerate(overload._schema.arguments)
                 if _is_list(argument) and not argument.kwarg_only]

    def decompose(*args, **kwargs):
        length = len(args[positions[0]])
        return [per_tensor(*(arg[k] if i in positions else arg for i, arg in enumerate(args)), **kwargs)
                for k in range(length)]

    decompose.__name__ = f"{overload._schema.name.split('::')[1]}_per_element"
    return decompose


def _norm(self, ord=2, dtype=None):  # noqa: A002 - the schema's name
    return aten.linalg_vector_norm(self, ord, dtype=dtype)


def _addcmul(self, tensor1, tensor2, value=1):  # value is positional in the foreach op, keyword-only here
    return aten.addcmul(self, tensor1, tensor2, value=value)


def _addcdiv(self, tensor1, tensor2, value=1):
    return aten.addcdiv(self, tensor1, tensor2, value=value)


def _maximum(self, other):  # amsgrad's running maximum of the second moment; a number: a clamp from below
    return aten.maximum(self, other) if isinstance(other, torch.Tensor) else aten.clamp_min(self, other)


# Per-tensor forms whose signature differs from the foreach op's (argument kinds or names).
ADAPTED = {"norm": _norm, "addcmul": _addcmul, "addcdiv": _addcdiv, "maximum": _maximum}


def _functional_overloads(packet):
    for name in packet.overloads():
        overload = getattr(packet, name)
        if not name.endswith("out") and f"{overload._schema.name.split('::')[1]}.{name}" not in KEPT_WHOLE:
            yield overload


@functools.cache
def _table() -> dict:
    table = {}
    for base in (*ELEMENTWISE, "norm"):
        per_tensor = ADAPTED.get(base) or getattr(aten, base)
        for overload in _functional_overloads(getattr(aten, f"_foreach_{base}")):
            table[overload] = per_element(per_tensor, overload)
    return table


def foreach_decompositions() -> dict:
    """A fresh copy of the foreach entries (``OpOverload -> decomposition``)."""
    return dict(_table())
