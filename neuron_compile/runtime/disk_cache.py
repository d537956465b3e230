"""Runtime stage: the persistent compile cache under ``NEURON_COMPILE_CACHE``, shared between processes.

Input: a key's parts (a dict of plain values: the normalized region graph, its input metadata, the config fields
that change kernels, the target, and the versions of torch, neuron_compile and the kernel backend) and a function
that produces the entry's payload (plain data) on a miss. Output: the payload, from disk on a hit.

Layout, under the cache root: ``v<FORMAT>/<key[:2]>/<key>.json`` is the entry (format, key, key parts,
payload, and a checksum of the payload), ``<key>.key.txt`` beside it is the key's parts as readable text, and
``<key>.lock`` the per-key lock. Safety, as the field's failures taught (aws-neuron-sdk#1023, #1368, vllm#26521):

* writes go to a temporary file in the entry's folder, then ``os.replace``: a reader sees the old entry, the new
  one, or none, never half of one, even if the writer is killed;
* a miss takes the key's lock (``flock``, polled up to a timeout, after which the compile goes ahead unlocked:
  a stuck process must not stop another), then looks again (double-checked), so racing processes and threads
  compile a key once;
* an entry that cannot be read, is truncated or garbage, has another format version, another key or a wrong
  checksum is a miss; the compile that follows rewrites it. Nothing here raises on a bad entry;
* an entry is data: JSON, never pickle, so reading one runs no code. A region's entry holds kernel texts that are
  executed when it is loaded, and a valid checksum says nothing of who wrote them (anyone who can write into a
  shared folder can compute one): the caller's ``accept`` loads the payload, and the launcher executes a kernel text
  only when it stays inside what our templates emit (codegen/kernel_check.py), with restricted builtins; one that
  does not is a miss like any bad entry (logged once with the rule and the line it breaks), compiled again and
  rewritten, never executed;
* a failed compile writes nothing: the next process retries it;
* the folder is bounded (``NEURON_COMPILE_CACHE_SIZE``): after a write that takes it over the bound, the least
  recently used entries (by mtime, which a hit refreshes) are deleted until it is at 90 % of the bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not on POSIX: no inter-process lock; writes stay atomic
    fcntl = None

import torch

from neuron_compile import process_groups
from neuron_compile.config import Config
from neuron_compile.passes.value_range import RANGE_KEY
from neuron_compile.runtime import stats
from neuron_compile.version import __version__

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: a rendered region holds its region kernel ("launch")
REGION_WHAT = "nki region"  # the ``what`` key part of a region's entry (a cost report's: runtime/report_cache.py)
OFF = "off"
LOCK_TIMEOUT_S = 120.0
LOCK_POLL_S = 0.02
EVICT_TO = 0.9  # after eviction the cache holds at most this fraction of its bound
ENTRY_SUFFIX = ".json"
KEY_RECORD_SUFFIX = ".key.txt"
LOCK_SUFFIX = ".lock"
TEMP_PREFIX = ".tmp-"
STALE_TEMP_S = 3600.0  # a temporary file this old belongs to a writer that died
# Config fields that do not change what a region compiles to: where things go, and what happens around a compile.
CONFIG_FIELDS_NOT_IN_KEY = ("cache_dir", "cache_size", "dump_dir", "recompile_warn", "fallback", "launcher", "replay",
                            "warm_start")


def cache_root(setting: str) -> Path | None:
    """The cache folder a ``cache_dir`` setting names: ``off`` is None, empty is the default folder."""
    if setting.strip().lower() == OFF:
        return None
    if setting:
        return Path(setting).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "neuron_compile"


# ---------------------------------------------------------------- keys


def canonical_json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def key_of(parts: dict) -> str:
    return hashlib.sha256(canonical_json(parts).encode()).hexdigest()[:40]


@functools.cache
def source_hash() -> str:
    """A hash of neuron_compile's own code and templates: a changed compiler is a new key, whatever its version."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".j2") and "__pycache__" not in path.parts:
            digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def kernel_backend_version() -> str:
    """The real ``nki`` package's version where it is installed, else the built-in simulator's."""
    for distribution in ("nki", "neuronx-cc"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{distribution} {importlib.metadata.version(distribution)}"
    return f"simulator {__version__}"


def versions() -> dict:
    return {
        "torch": torch.__version__, "neuron_compile": f"{__version__}+src.{source_hash()}",
        "kernel_backend": kernel_backend_version(),
    }


def config_key(config: Config | None) -> dict:
    """The config fields a compile depends on (every field not known to be irrelevant, so new ones count)."""
    config = config if config is not None else Config()
    return {
        field.name: getattr(config, field.name)
        for field in dataclasses.fields(config)
        if field.name not in CONFIG_FIELDS_NOT_IN_KEY
    }


def meta_text(value) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}{list(value.shape)} strides {list(value.stride())} offset {value.storage_offset()}"
    if isinstance(value, list | tuple):
        return "(" + ", ".join(meta_text(item) for item in value) + ")"
    return type(value).__name__ if value is not None else "-"


def normalized_graph(gm: torch.fx.GraphModule) -> list[str]:
    """The graph as one line per node, names replaced by positions (``%3``), each with its result's metadata:
    two regions that differ only in node names (layer 0 and layer 1 of a model) have one key."""
    position = {node: index for index, node in enumerate(gm.graph.nodes)}

    def argument(value) -> str:
        if isinstance(value, torch.fx.Node):
            return f"%{position[value]}"
        if isinstance(value, list | tuple):
            inner = ", ".join(argument(item) for item in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner})"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{key}: {argument(item)}" for key, item in value.items()) + "}"
        return repr(value)

    lines = []
    for node in gm.graph.nodes:
        target = node.target if isinstance(node.target, str) and node.op != "call_function" else str(node.target)
        if node.op == "placeholder":
            target = "input"
        text = f"%{position[node]} = {node.op} {target}({argument(node.args)}, {argument(node.kwargs)})"
        lines.append(f"{text} : {meta_text(node.meta.get('val'))}")
    return lines


def region_key_parts(gm: torch.fx.GraphModule, example_inputs, config: Config | None, target_name: str) -> dict:
    """The parts of one NKI region's key: what the lower pass reads (graph, inputs, and the value bounds its inputs
    carry: passes/input_ranges.py) and what changes its result."""
    parts = {
        "format": FORMAT_VERSION,
        "what": REGION_WHAT,
        "graph": normalized_graph(gm),
        "inputs": [meta_text(value) for value in example_inputs],
        "config": config_key(config),
        "target": target_name,
        "versions": versions(),
    }
    ranges = [str(node.meta.get(RANGE_KEY)) for node in gm.graph.nodes if node.op == "placeholder"]
    if any(bound != "None" for bound in ranges):  # absent otherwise: keys of regions without bounds are unchanged
        parts["input ranges"] = ranges
    groups = process_groups.graph_groups(gm)
    if groups:  # the kernels name the groups' ranks; absent otherwise, as above
        parts["process groups"] = groups
    return parts


def key_record_text(key: str, parts: dict) -> str:
    """The key's parts as readable text (the file beside each entry)."""
    lines = [f"key: {key}"]
    for name, value in parts.items():
        if isinstance(value, list):
            lines.append(f"{name}:")
            lines += [f"  {item}" for item in value]
        elif isinstance(value, dict):
            lines.append(f"{name}:")
            lines += [f"  {field}: {item}" for field, item in value.items()]
        else:
            lines.append(f"{name}: {value}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- entries


@dataclasses.dataclass(frozen=True)
class EntryInfo:
    key: str
    path: Path
    size: int  # bytes of the entry and its key record
    last_used: float  # mtime: written or last hit


class CorruptEntry(ValueError):
    """An entry file that is not a valid entry for its key; the message says what is wrong."""


def read_entry(path: Path, key: str) -> dict:
    """The entry at ``path`` as a dict with ``parts`` and ``payload``; raises ``CorruptEntry`` (or OSError)."""
    try:
        entry = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptEntry(f"not JSON ({error.msg if hasattr(error, 'msg') else error})") from error
    if not isinstance(entry, dict):
        raise CorruptEntry("not a JSON object")
    if entry.get("format") != FORMAT_VERSION:
        raise CorruptEntry(f"format {entry.get('format')!r}, this neuron_compile reads {FORMAT_VERSION}")
    if entry.get("key") != key:
        raise CorruptEntry(f"written for key {entry.get('key')!r}")
    parts, payload = entry.get("parts"), entry.get("payload")
    if not isinstance(parts, dict) or key_of(parts) != key:
        raise CorruptEntry("its key parts do not hash to its key")
    if not isinstance(payload, dict) or entry.get("checksum") != _checksum(payload):
        raise CorruptEntry("payload checksum mismatch")
    return entry


def _checksum(payload: dict) -> str:
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def _write_atomically(path: Path, text: str) -> int:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``; returns bytes."""
    data = text.encode()
    with tempfile.NamedTemporaryFile("wb", dir=path.parent, prefix=TEMP_PREFIX, delete=False) as handle:
        handle.write(data)
    try:
        os.chmod(handle.name, 0o644)  # readable like any file the user writes (the temp file starts 0600)
        os.replace(handle.name, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(handle.name)
        raise
    return len(data)


class DiskCache:
    """One cache folder. ``get_or_create(parts, create)`` is the whole interface the compiler uses."""

    def __init__(self, root: Path, max_bytes: int = 0, lock_timeout_s: float = LOCK_TIMEOUT_S):
        self.root = Path(root)
        self.directory = self.root / f"v{FORMAT_VERSION}"
        self.max_bytes = max_bytes  # 0: unbounded
        self.lock_timeout_s = lock_timeout_s
        self._size_lock = threading.Lock()
        self._known_bytes: int | None = None  # this process's view of the folder's size (None: not yet scanned)
        self._reported: set[tuple[Path, str]] = set()  # unusable entries already logged, with their reason
        self._reported_lock = threading.Lock()

    def entry_path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}{ENTRY_SUFFIX}"

    # -- lookups

    def lookup(self, key: str, accept: Callable[[dict], object] | None = None, with_parts: bool = False):
        """The payload stored under ``key`` (with ``accept``: what it makes of the payload, or of the key's parts and
        the payload ``with_parts``), or None: absent, unreadable, corrupt, or refused by ``accept`` (a ``ValueError``,
        as a kernel text outside the subset our templates emit: codegen/kernel_check.py), each a miss."""
        path = self.entry_path(key)
        try:
            entry = read_entry(path, key)
            payload = entry["payload"]
            if accept is None:
                value = payload
            else:
                value = accept(entry["parts"], payload) if with_parts else accept(payload)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:  # CorruptEntry is a ValueError
            self._report_unusable(path, error)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # least recently used means least recently hit, too
        return value

    def _report_unusable(self, path: Path, error: Exception) -> None:
        """Count every unusable lookup; log each entry's reason once per process (a miss looks twice)."""
        stats.add(disk_cache_corrupt=1)
        with self._reported_lock:
            first = (path, str(error)) not in self._reported
            self._reported.add((path, str(error)))
        if first:
            log.warning("neuron_compile: disk cache entry %s is unusable (%s); compiling it again", path, error)

    def get_or_create(self, parts: dict, create: Callable[[], dict],
                      accept: Callable[[dict], object] | None = None) -> tuple[object, bool]:
        """``(value, created_now)``: the stored payload, or ``create()``'s, written before it is returned. With
        ``accept``, the value is ``accept(payload)``; a stored payload it refuses is a miss (``lookup``), and a created
        one it refuses raises and is not written."""
        key = key_of(parts)
        value = self.lookup(key, accept)
        if value is not None:
            return value, False
        with self._key_lock(key):
            value = self.lookup(key, accept)  # another process or thread may have written it while this one waited
            if value is not None:
                return value, False
            payload = create()  # an exception leaves nothing behind: the next attempt compiles again
            value = accept(payload) if accept is not None else payload
            self.store(key, parts, payload)
        return value, True

    # -- writes

    def store(self, key: str, parts: dict, payload: dict) -> None:
        """Write one entry (and its readable key record); a failure to write is logged, never raised."""
        path = self.entry_path(key)
        entry = {"format": FORMAT_VERSION, "key": key, "parts": parts, "payload": payload,
                 "checksum": _checksum(payload)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            written = _write_atomically(path.with_name(key + KEY_RECORD_SUFFIX), key_record_text(key, parts))
            written += _write_atomically(path, json.dumps(entry, indent=1, sort_keys=True))
        except OSError as error:
            log.warning("neuron_compile: could not write disk cache entry %s: %s", path, error)
            return
        self._account(written)

    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        """The per-key lock: ``flock`` on ``<key>.lock``, polled up to the timeout; after it, go on unlocked."""
        lock_path = self.entry_path(key).with_name(key + LOCK_SUFFIX)
        try:
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(lock_path, "a+b")  # noqa: SIM115 -- closed in the finally below
        except OSError as error:
            log.warning("neuron_compile: no lock for disk cache key %s (%s); compiling unlocked", key, error)
            yield
            return
        try:
            if fcntl is not None and not self._acquire(handle, key):
                log.warning(
                    "neuron_compile: disk cache key %s stayed locked for %.0f s; compiling without the lock",
                    key, self.lock_timeout_s,
                )
            yield
        finally:
            handle.close()  # closing releases the flock

    def _acquire(self, handle, key: str) -> bool:
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(LOCK_POLL_S)

    # -- size bound

    def _account(self, written: int) -> None:
        if not self.max_bytes:
            return
        with self._size_lock:
            if self._known_bytes is None:
                self._known_bytes = sum(info.size for info in self.entries())
            else:
                self._known_bytes += written
            if self._known_bytes > self.max_bytes:
                self._known_bytes = self.evict(int(self.max_bytes * EVICT_TO))

    def evict(self, keep_bytes: int) -> int:
        """Delete least recently used entries until at most ``keep_bytes`` remain; returns the bytes left."""
        infos = sorted(self.entries(), key=lambda info: info.last_used)
        total = sum(info.size for info in infos)
        for info in infos:
            if total <= keep_bytes:
                break
            self.remove(info.key)
            total -= info.size
            stats.add(disk_cache_evictions=1)
        self.remove_stale_temporaries()
        return total

    # -- maintenance (the ``neuron-compile cache`` CLI)

    def entries(self) -> list[EntryInfo]:
        infos = []
        if not self.directory.is_dir():
            return infos
        for path in self.directory.glob(f"*/*{ENTRY_SUFFIX}"):
            key = path.name.removesuffix(ENTRY_SUFFIX)
            record = path.with_name(key + KEY_RECORD_SUFFIX)
            try:
                status = path.stat()
                size = status.st_size + (record.stat().st_size if record.exists() else 0)
            except OSError:
                continue  # removed meanwhile
            infos.append(EntryInfo(key, path, size, status.st_mtime))
        return infos

    def resolve(self, prefix: str) -> list[str]:
        """The keys that start with ``prefix``."""
        return sorted(info.key for info in self.entries() if info.key.startswith(prefix.strip().lower()))

    def read(self, key: str) -> dict:
        """The whole entry (parts and payload); raises ``CorruptEntry`` or ``OSError``."""
        return read_entry(self.entry_path(key), key)

    def verify(self, check: Callable[[dict], None] | None = None) -> list[tuple[str, str]]:
        """``(key, problem)`` for every entry that a lookup would treat as a miss; ``check(entry)`` raises a
        ``ValueError`` for an entry whose content its reader would refuse (the CLI checks regions' kernel texts)."""
        problems = []
        for info in self.entries():
            try:
                entry = self.read(info.key)
                if check is not None:
                    check(entry)
            except (OSError, ValueError) as error:
                problems.append((info.key, str(error)))
        return problems

    def remove(self, key: str) -> None:
        path = self.entry_path(key)
        for stale in (path, path.with_name(key + KEY_RECORD_SUFFIX), path.with_name(key + LOCK_SUFFIX)):
            with contextlib.suppress(OSError):
                stale.unlink()

    def remove_stale_temporaries(self, older_than_s: float = STALE_TEMP_S) -> int:
        removed = 0
        now = time.time()
        for path in self.directory.glob(f"*/{TEMP_PREFIX}*") if self.directory.is_dir() else ():
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime >= older_than_s:
                    path.unlink()
                    removed += 1
        return removed

    def clear(self) -> int:
        """Delete every entry (and stray temporary files); returns the number of entries deleted."""
        infos = self.entries()
        for info in infos:
            self.remove(info.key)
        self.remove_stale_temporaries(older_than_s=0.0)
        with self._size_lock:
            self._known_bytes = None
        return len(infos)


_open_caches: dict[tuple[str, int], DiskCache] = {}
_open_caches_lock = threading.Lock()


def open_cache(config: Config | None) -> DiskCache | None:
    """The process's ``DiskCache`` for ``config``'s folder and bound; None when the cache is ``off`` or there is no
    config (a direct ``compile_region`` call without one, as tests make, never touches the disk)."""
    if config is None:
        return None
    root = cache_root(config.cache_dir)
    if root is None:
        return None
    with _open_caches_lock:
        cache = _open_caches.get((str(root), config.cache_size))
        if cache is None:
            cache = _open_caches[(str(root), config.cache_size)] = DiskCache(root, config.cache_size)
        return cache
