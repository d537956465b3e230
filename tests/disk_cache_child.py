"""A separate process for tests/test_disk_cache.py: compiles a small model with backend="neuron" under the
NEURON_COMPILE_CACHE it is given and prints one JSON line (the output's bytes hashed, the stats, the kernels).

``python disk_cache_child.py compile`` does that; ``python disk_cache_child.py killed-write CACHE MODE`` writes one
entry and SIGKILLs itself in the middle of the write (MODE ``mid-write``: half the entry's bytes written;
``before-rename``: the temporary file complete, not yet renamed)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import torch


def model(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.layer_norm(x @ w + b, (w.shape[1],))
    return torch.softmax(torch.relu(h) * 2.0 - 1.0, dim=-1).sum(dim=0)


def compile_and_report() -> None:
    import neuron_compile

    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=generator) for shape in ((96, 64), (64, 160), (160,)))
    with torch.no_grad():
        out = torch.compile(model, backend="neuron")(x, w, b)
    stats = neuron_compile.stats()
    record = neuron_compile.last_compiled()
    print(json.dumps({
        "output": hashlib.sha256(out.numpy().tobytes()).hexdigest(),
        "stats": {name: value for name, value in stats.items() if name != "fallback_reasons"},
        "kernels": [kernel.source for kernel in record.kernels],
    }))


def killed_write(root: str, mode: str) -> None:
    from neuron_compile.runtime import disk_cache

    def die() -> None:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    if mode == "before-rename":
        real_replace = disk_cache.os.replace

        def replace_or_die(source, target):
            if str(target).endswith(".key.txt"):
                return real_replace(source, target)  # the key record lands; the entry itself never does
            return die()

        disk_cache.os.replace = replace_or_die
    else:
        real_dumps = disk_cache.json.dumps

        def half_then_die(value, **kwargs):
            text = real_dumps(value, **kwargs)
            if isinstance(value, dict) and "payload" in value:
                disk_cache.tempfile.NamedTemporaryFile = _dying_temporary_file(len(text) // 2, die)
            return text

        disk_cache.json.dumps = half_then_die
    cache = disk_cache.DiskCache(root)
    cache.store("ab" * 20, {"what": "test"}, {"kernels": ["x" * 100_000]})
    print("not killed")


def _dying_temporary_file(limit: int, die):
    import tempfile

    real = tempfile.NamedTemporaryFile

    def create(*args, **kwargs):
        handle = real(*args, **kwargs)
        write = handle.write

        def partial_write(data):
            write(data[:limit])
            handle.flush()
            die()

        handle.write = partial_write
        return handle

    return create


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_and_report()
    else:
        killed_write(sys.argv[2], sys.argv[3])
