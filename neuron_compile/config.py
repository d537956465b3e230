"""Configuration: one frozen ``Config`` read from ``NEURON_COMPILE_*`` environment variables.

Input: the environment, ``config.patch(**overrides)`` blocks, and ``torch.compile(..., options={...})``.
Output: a frozen, hashable ``Config`` — hashable because it is part of every compiled-graph cache key. A bad value
is a ``ValueError`` that names the variable (or option) and the valid values; a ``NEURON_COMPILE_*`` variable that is
none of these is ignored with a warning that lists them (a typo would otherwise pass silently).

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
NEURON_COMPILE_BUCKET      bucket                pad dynamic sizes of inference graphs up to a multiple of this
                                                 (0: off; passes/bucket.py)
NEURON_COMPILE_RECOMPILE_WARN  recompile_warn    warn when one graph has compiled this many shape signatures
NEURON_COMPILE_LAUNCHER    launcher              ``auto`` (default: the device where the real ``nki`` and a
                                                 Neuron device are present, else the simulator) |
                                                 ``simulator`` | ``device`` (runtime/launcher.py)
NEURON_COMPILE_FUSION      fusion                ``1`` (default) | ``0``: fuse IR nodes into kernels (0: one kernel
                                                 per lowered node, to measure what fusion saves; passes/fusion.py)
NEURON_COMPILE_FLASH_ATTENTION  flash_attention  ``1`` (default) | ``0``: SDPA as one flash-attention kernel
                                                 (0: scores, softmax and output as three kernels, the scores
                                                 through HBM; to measure what the flash kernel saves)
NEURON_COMPILE_FLASH_DECODE  flash_decode        ``1`` (default) | ``0``: attention with few query rows per tile
                                                 (decode) splits the keys across the partitions
                                                 (kinds/attention_decode.py; 0: the flash kernel's query tiles,
                                                 to measure what the split saves)
NEURON_COMPILE_LAUNCH_UNIT  launch_unit          ``region`` (default: a region's kernels launched as one kernel,
                                                 codegen/region_text.py) | ``kernel`` (one launch per kernel;
                                                 to measure what one launch per region saves)
NEURON_COMPILE_TRANSPOSED_WEIGHTS  transposed_weights  ``1`` (default) | ``0``: inference graphs read a column-major
                                                 copy of each weight parameter their matmuls read transposed,
                                                 made once per weight version (runtime/weight_layouts.py; costs
                                                 one more copy of those weights in memory)
NEURON_COMPILE_REPLAY      replay                ``1`` (default) | ``0``: a simulated kernel launched again with
                                                 the shapes and dtypes of an earlier launch replays the numpy work
                                                 that launch recorded (runtime/simulator/replay.py; 0: every launch
                                                 simulated in full)
NEURON_COMPILE_WARM_START  warm_start            ``1`` (default) | ``0``: a new process over a filled on-disk cache
                                                 runs a Dynamo graph that compiled to one NKI region straight from
                                                 its warm-start record, without aot_autograd's trace, when the
                                                 record's key and checks hold (runtime/warm_start.py; 0: aot_autograd
                                                 traces every graph)
NEURON_COMPILE_LOGS        logs                  log topics, ``TORCH_LOGS``-style: ``+dispatch,cache`` (logs.py)
=========================  ====================  ===========================================================

``get()`` runs on every call of a compiled graph (the config is part of the dispatch key), so it is memoized on
the values of our variables and the active ``patch()`` blocks: a call reads those and looks the Config up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import warnings
from collections.abc import Iterator, Mapping

from neuron_compile import logs

FALLBACK_MODES = ("warn", "raise", "silent")
LAUNCHERS = ("auto", "simulator", "device")
LAUNCH_UNITS = ("region", "kernel")
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
    flash_decode: bool = True
    launch_unit: str = "region"
    transposed_weights: bool = True
    replay: bool = True
    warm_start: bool = True
    logs: str = ""

    def __post_init__(self):
        for name in self.field_names():
            check_value(name, getattr(self, name), source=name)

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
        coerced = {}
        for key, value in changes.items():
            source = f"option {key!r}"
            coerced[key] = check_value(key, _coerce(key, value, source=source), source=source)
        return dataclasses.replace(self, **coerced)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """The configuration the ``NEURON_COMPILE_*`` variables describe (unset variables keep the default)."""
        environ = os.environ if environ is None else environ
        values = {}
        for name in cls.field_names():
            variable = env_variable(name)
            if variable in environ:
                values[name] = check_value(name, _coerce(name, environ[variable], source=variable), source=variable)
        for variable in environ:
            if variable.startswith(ENV_PREFIX) and variable not in ENV_VARIABLES:
                _warn_unknown_variable(variable)
        return cls(**values)


def env_variable(name: str) -> str:
    """The environment variable of a Config field: ``fallback`` -> ``NEURON_COMPILE_FALLBACK``."""
    return ENV_PREFIX + _ENV_NAMES.get(name, name.upper())


ENV_VARIABLES = tuple(env_variable(field.name) for field in dataclasses.fields(Config))


@functools.cache
def _warn_unknown_variable(variable: str) -> None:
    warnings.warn(f"{variable} is not a neuron_compile variable (a typo?); it is ignored. The variables are: "
                  f"{', '.join(ENV_VARIABLES)}", stacklevel=4)


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
    if name in ("fusion", "flash_attention", "flash_decode", "transposed_weights", "replay",
                "warm_start"):
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
    return value.lower() if name in ("fallback", "target", "launcher", "launch_unit") else value


# Fields whose value is one of a fixed set of words.
CHOICES = {
    "fallback": FALLBACK_MODES, "launcher": LAUNCHERS, "launch_unit": LAUNCH_UNITS, "target": tuple(TARGET_ALIASES),
}
# Integer fields: (smallest valid value, what the valid values are).
INTEGER_BOUNDS = {
    "bucket": (0, "0 (off) or a positive multiple to pad to"),
    "cache_size": (0, ">= 0 bytes (0: unbounded)"),
    "recompile_warn": (1, "an integer >= 1"),
}


def check_value(name: str, value: object, source: str) -> object:
    """``value`` if it is valid for field ``name``; else a ValueError naming ``source`` (the environment variable
    or option it came from) and the valid values."""
    if name == "logs":
        logs.parse(value, source)
    if name in CHOICES and value not in CHOICES[name]:
        raise ValueError(f"{source} must be one of {list(CHOICES[name])}, got {value!r}")
    if name in INTEGER_BOUNDS:
        lowest, valid = INTEGER_BOUNDS[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise ValueError(f"{source} must be {valid}, got {value!r}")
    return value


_overrides = threading.local()
# Our variables' values in the environment, read the cheap way: os.environ's getter encodes the key and decodes
# the value in Python (~2 us a variable), and get() runs on every call of a compiled graph. On POSIX, os.environ
# keeps its bytes mapping in ``_data`` (written by every os.environ change); elsewhere, the public getter.
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS = tuple(os.fsencode(variable) for variable in ENV_VARIABLES) if os.name == "posix" else ()
_MEMO_LIMIT = 64
_memo: dict[tuple, Config] = {}


def _override_stack() -> list[tuple]:
    """This thread's patch() overrides, innermost last, each as a tuple of (key, value) items."""
    if not hasattr(_overrides, "stack"):
        _overrides.stack = []
    return _overrides.stack


def _environment_fingerprint() -> tuple:
    """What get() depends on in the environment: our variables' values, and the number of variables (a new
    NEURON_COMPILE_* typo must reach from_env's warning)."""
    if _ENV_KEYS and isinstance(_ENVIRON_DATA, dict):
        return len(_ENVIRON_DATA), tuple(map(_ENVIRON_DATA.get, _ENV_KEYS))
    return len(os.environ), tuple(map(os.environ.get, ENV_VARIABLES))


def get(options: Mapping[str, object] | tuple = ()) -> Config:
    """The current configuration: the environment, then any active ``patch()`` blocks, innermost last, then
    ``options`` (torch.compile's; a mapping, or its items as a tuple). Memoized (see the module docstring)."""
    items = options if isinstance(options, tuple) else tuple(options.items())  # not Mapping's slower ABC check
    key = (_environment_fingerprint(), tuple(_override_stack()), items)
    try:
        return _memo[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable option value: no memo
        return _build(items)
    current = _build(items)
    if len(_memo) >= _MEMO_LIMIT:
        _memo.clear()
    _memo[key] = current
    return current


def _build(options: tuple) -> Config:
    current = Config.from_env()
    for overrides in _override_stack():
        current = current.replace(dict(overrides))
    return current.replace(dict(options)) if options else current


@contextlib.contextmanager
def patch(**overrides) -> Iterator[Config]:
    """Override configuration fields inside a ``with`` block (this thread only); yields the patched Config."""
    patched = get().replace(overrides)  # validate before entering the block
    stack = _override_stack()
    stack.append(tuple(overrides.items()))
    try:
        yield patched
    finally:
        stack.pop()
