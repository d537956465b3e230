"""Configuration: one frozen ``Config`` read from ``NEURON_COMPILE_*`` environment variables.

Input: the environment, ``config.patch(**overrides)`` blocks, and ``torch.compile(..., options={...})``.
Output: a frozen, hashable ``Config`` — hashable because it is part of every compiled-graph cache key.

=========================  ====================  ===========================================================
environment variable       field (option key)    meaning
=========================  ====================  ===========================================================
NEURON_COMPILE_FALLBACK    fallback              ``warn`` (default) | ``raise`` | ``silent``: what a region
                                                 that cannot be compiled does (eager + warning, error, eager)
NEURON_COMPILE_TARGET      target                ``trn1`` | ``trn2`` (default) | ``trn3`` (aliases inf2,
                                                 gen2, gen3, gen4)
NEURON_COMPILE_CACHE       cache_dir             on-disk kernel cache directory (empty: the default,
                                                 ``$XDG_CACHE_HOME/neuron_compile`` or ``~/.cache/neuron_compile``;
                                                 ``off``: memory only) (runtime/disk_cache.py)
NEURON_COMPILE_CACHE_SIZE  cache_size            the on-disk cache's bound in bytes (suffix K, M or G allowed;
                                                 default 1G; 0: unbounded); least recently used entries go first
NEURON_COMPILE_DUMP        dump_dir              directory for graph / kernel dumps (empty: no dumps)
NEURON_COMPILE_BUCKET      bucket                pad dynamic dimensions up to a multiple of this (0: off)
NEURON_COMPILE_RECOMPILE_WARN  recompile_warn    warn when one graph has compiled this many shape signatures
NEURON_COMPILE_LAUNCHER    launcher              ``auto`` (default: the device where the real ``nki`` and a
                                                 Neuron device are present, else the simulator) |
                                                 ``simulator`` | ``device`` (runtime/launcher.py)
NEURON_COMPILE_FUSION      fusion                ``1`` (default) | ``0``: fuse IR nodes into kernels (0: one kernel
                                                 per lowered node, to measure what fusion saves; passes/fusion.py)
NEURON_COMPILE_FLASH_ATTENTION  flash_attention  ``1`` (default) | ``0``: SDPA as one flash-attention kernel
                                                 (0: scores, softmax and output as three kernels, the scores
                                                 through HBM; to measure what the flash kernel saves)
=========================  ====================  ===========================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Mapping

FALLBACK_MODES = ("warn", "raise", "silent")
LAUNCHERS = ("auto", "simulator", "device")
# The simulator's target names and the aliases the real ``nki`` accepts (NEURON_PLATFORM_TARGET_OVERRIDE).
TARGET_ALIASES = {
    "trn1": "trn1",
    "inf2": "trn1",
    "gen2": "trn1",
    "trn2": "trn2",
    "gen3": "trn2",
    "trn3": "trn3",
    "gen4": "trn3",
}
ENV_PREFIX = "NEURON_COMPILE_"
# Field name -> environment variable suffix, where they differ from FIELD.upper().
_ENV_NAMES = {"cache_dir": "CACHE", "dump_dir": "DUMP"}
_BOOLEANS = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}
_SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
DEFAULT_CACHE_SIZE = 1 << 30


@dataclasses.dataclass(frozen=True)
class Config:
    fallback: str = "warn"
    target: str = "trn2"
    cache_dir: str = ""
    cache_size: int = DEFAULT_CACHE_SIZE
    dump_dir: str = ""
    bucket: int = 0
    recompile_warn: int = 8  # torch._dynamo.config.recompile_limit's default: a storm starts here
    launcher: str = "auto"
    fusion: bool = True
    flash_attention: bool = True

    def __post_init__(self):
        _validate(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    def replace(self, options: Mapping[str, object] | None = None, **overrides) -> Config:
        """A copy with ``options`` / ``overrides`` applied; unknown keys and bad values raise ``ValueError``."""
        changes = {**(options or {}), **overrides}
        unknown = sorted(key for key in changes if key not in self.field_names())
        if unknown:
            raise ValueError(
                f"unknown neuron_compile option(s) {unknown}: valid options are {list(self.field_names())}"
            )
        coerced = {key: _coerce(key, value, source=f"option {key!r}") for key, value in changes.items()}
        return dataclasses.replace(self, **coerced)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """The configuration the ``NEURON_COMPILE_*`` variables describe (unset variables keep the default)."""
        environ = os.environ if environ is None else environ
        values = {}
        for name in cls.field_names():
            variable = ENV_PREFIX + _ENV_NAMES.get(name, name.upper())
            if variable in environ:
                values[name] = _coerce(name, environ[variable], source=variable)
        return cls(**values)


def _coerce_size(value: object, source: str) -> int:
    """Bytes from an int or a string such as ``"512M"`` (suffixes K, M, G: powers of 1024)."""
    if isinstance(value, str):
        text = value.strip().lower().removesuffix("b")
        scale = _SIZE_SUFFIXES.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in _SIZE_SUFFIXES else text
        if digits.isdigit():
            return int(digits) * scale
    elif isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"{source} must be a size in bytes (e.g. 1073741824, 512M, 2G), got {value!r}")


def _coerce(name: str, value: object, source: str) -> object:
    """Convert a string (from the environment) or a Python value to the field's type, naming the source."""
    if name == "cache_size":
        return _coerce_size(value, source)
    if name in ("fusion", "flash_attention"):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _BOOLEANS:
            return _BOOLEANS[value.strip().lower()]
        raise ValueError(f"{source} must be a boolean (1/0, true/false, on/off), got {value!r}")
    if name in ("bucket", "recompile_warn"):
        if isinstance(value, bool):
            raise ValueError(f"{source} must be an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{source} must be an integer, got {value!r}") from None
    if name in ("cache_dir", "dump_dir") and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        # ValueError, like every other bad option value, so callers catch one exception type for bad config.
        raise ValueError(f"{source} must be a string, got {type(value).__name__} {value!r}")  # noqa: TRY004
    value = value.strip()
    return value.lower() if name in ("fallback", "target", "launcher") else value


def _validate(config: Config) -> None:
    if config.fallback not in FALLBACK_MODES:
        raise ValueError(f"fallback must be one of {list(FALLBACK_MODES)}, got {config.fallback!r}")
    if config.launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {list(LAUNCHERS)}, got {config.launcher!r}")
    if config.target not in TARGET_ALIASES:
        raise ValueError(f"target must be one of {sorted(TARGET_ALIASES)}, got {config.target!r}")
    if config.bucket < 0:
        raise ValueError(f"bucket must be 0 (off) or a positive multiple to pad to, got {config.bucket}")
    if config.cache_size < 0:
        raise ValueError(f"cache_size must be >= 0 bytes (0: unbounded), got {config.cache_size}")
    if config.recompile_warn < 1:
        raise ValueError(f"recompile_warn must be >= 1, got {config.recompile_warn}")


_overrides = threading.local()


def _override_stack() -> list[dict]:
    if not hasattr(_overrides, "stack"):
        _overrides.stack = []
    return _overrides.stack


def get() -> Config:
    """The current configuration: the environment, then any active ``patch()`` blocks, innermost last."""
    current = Config.from_env()
    for overrides in _override_stack():
        current = current.replace(overrides)
    return current


@contextlib.contextmanager
def patch(**overrides) -> Iterator[Config]:
    """Override configuration fields inside a ``with`` block (this thread only); yields the patched Config."""
    patched = get().replace(overrides)  # validate before entering the block
    stack = _override_stack()
    stack.append(overrides)
    try:
        yield patched
    finally:
        stack.pop()
