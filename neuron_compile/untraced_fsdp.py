"""Dynamo compile callback (installed with the backend): say so when FSDP2's hooks stop a compile.

FSDP2's module hooks (``torch.distributed.fsdp``'s ``fully_shard``) are ``torch._dynamo.disable``d, so a whole
``fully_shard``-ed model passed to ``torch.compile`` breaks its graph at every hook and runs the code around them
eagerly: the backend gets only the pieces between hooks, as graphs of their own, and nothing says so. At the end of
every Dynamo frame compile, the graph breaks recorded since the last look are checked; the first at each source line
in FSDP2's package gets a ``NeuronCompileWarning`` naming the two recipes that compile whole layers. Compiling each
layer after ``fully_shard`` (the hooks stay outside the layer's frame) records no such break: no warning.
"""

from __future__ import annotations

import threading
import warnings

import torch

from neuron_compile.errors import NeuronCompileWarning

FSDP_PACKAGE = "torch/distributed/fsdp/"
MESSAGE = (
    "torch.compile broke the graph at FSDP2's hooks ({where}): Dynamo does not trace them, so the code around them "
    "runs eagerly, the backend gets only the pieces between them as separate graphs, and FSDP2's collectives stay "
    "outside them. Compile each layer after fully_shard (layer.compile(...)), or shard with "
    "neuron_compile.in_graph_fsdp.fully_shard_in_graph and compile the whole model (its all-gathers and "
    "reduce-scatters become kernels)."
)

_lock = threading.Lock()
# Dynamo's graph-break reasons checked so far: how many, and the last of them (``torch._dynamo.reset()`` empties
# the list, and a list refilled past the old count is told apart by its element at that place)
_seen = {"count": 0, "last": None}
_warned: set[str] = set()  # the FSDP2 source lines warned about since the last reset (a break repeats per layer)


def fsdp_frame(reason) -> str | None:
    """``file:line`` of a graph break's innermost user frame when it lies in FSDP2's package, else None."""
    stack = getattr(reason, "user_stack", None) or []
    if not stack or FSDP_PACKAGE not in stack[-1].filename.replace("\\", "/"):
        return None
    return f"{stack[-1].filename.split('site-packages/')[-1]}:{stack[-1].lineno}"


def check_new_graph_breaks(_callback_args=None) -> None:
    """Warn for new graph breaks at FSDP2's hooks, once per source line (Dynamo's end-of-compile callback)."""
    for reason in unchecked(torch._dynamo.utils.graph_break_reasons):
        where = fsdp_frame(reason)
        if where is None:
            continue
        with _lock:
            first = where not in _warned
            _warned.add(where)
        if first:
            warnings.warn(MESSAGE.format(where=where), NeuronCompileWarning, stacklevel=2)


def unchecked(reasons: list) -> list:
    """The graph-break reasons not checked yet. After ``torch._dynamo.reset()`` every reason is new, and each
    source line is warned about again: the user started over."""
    with _lock:
        count = _seen["count"]
        continued = 0 < count <= len(reasons) and reasons[count - 1] is _seen["last"]
        if not continued:
            _warned.clear()
        _seen.update(count=len(reasons), last=reasons[-1] if reasons else None)
        return list(reasons[count if continued else 0:])


def install() -> None:
    """Register the check with Dynamo's compile callbacks unless it is there. ``torch._dynamo.reset()`` clears
    them: the backend installs it again when it registers and at each compile."""
    handler = torch._dynamo.callback_handler
    with _lock:
        if check_new_graph_breaks not in handler.end_callbacks:
            handler.register_end_callback(check_new_graph_breaks)
