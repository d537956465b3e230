"""Simulator stage: ``nki.typing`` — the annotation helpers kernels may use (``nt.tensor[128, 512]``).

Input: subscripted shapes / dtypes in kernel annotations. Output: an annotation object that records them; the
simulator checks nothing from annotations (shapes come from the arguments), it only lets such kernels load.
"""

from __future__ import annotations


class _Annotation:
    __slots__ = ("kind", "params")

    def __init__(self, kind: str, params: tuple):
        self.kind, self.params = kind, params

    def __repr__(self) -> str:
        return f"nt.{self.kind}[{', '.join(map(repr, self.params))}]"


class tensor:  # noqa: N801 - NKI's name
    """``nt.tensor[shape..., dtype]`` annotation."""

    def __class_getitem__(cls, params) -> _Annotation:
        return _Annotation("tensor", params if isinstance(params, tuple) else (params,))


class mutable_tensor(tensor):  # noqa: N801
    """``nt.mutable_tensor[...]``: an argument the kernel writes."""

    def __class_getitem__(cls, params) -> _Annotation:
        return _Annotation("mutable_tensor", params if isinstance(params, tuple) else (params,))
