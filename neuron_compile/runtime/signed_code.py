"""Runtime stage: kernel texts' compiled code kept in the on-disk cache, signed with the user's own key.

Input: a kernel's ``KernelSource`` and, after a miss, the code object ``launcher.checked_code`` compiled from it once
codegen/kernel_check.py admitted the text. Output: that code object in a later process, without parsing, checking
and compiling the text again, or None.

Why: a warm start loads each region's kernel text from the on-disk cache, and the check and compile of Llama's
region text (132 KB) took ~0.1 s of CPU, half of what the backend adds to Dynamo's trace on a warm start (issue 11).

Why this is safe in a folder other users can write: the code is executed without the text check only when its entry
carries an HMAC-SHA256 tag made with this user's signing key, a random 32-byte file only its owner can read
(``key_path()``: the user's config folder, never the cache folder). Anyone can write an entry, copy one from another
machine or change one; nobody without the key can make a tag that verifies, so such an entry is a miss: the text is
checked and compiled as before, and a signed entry rewritten. The tag covers the key's parts (which name the text's
hash, the Python bytecode's magic number and our source hash, so a changed checker is a new key) and the code bytes.
Each user's entries are keyed by their key's fingerprint, so two users sharing a folder do not overwrite each
other's. Without a usable key (no home folder, a key file another user owns or can read), nothing is signed or
trusted: every load checks the text.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import importlib.util
import logging
import marshal
import os
import sys
import threading
import types
from pathlib import Path

from neuron_compile.config import Config
from neuron_compile.runtime import disk_cache

log = logging.getLogger(__name__)

FORMAT = 1  # of a code entry's key parts and payload
WHAT = "kernel code"  # a code entry's ``what`` key part (a region's is "nki region", a report's "cost report")
KEY_BYTES = 32
KEY_FILE = "signing-key"


def key_path() -> Path:
    """Where this user's signing key lives: ``$XDG_CONFIG_HOME/neuron_compile`` or ``~/.config/neuron_compile``."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "neuron_compile" / KEY_FILE


def read_private_key(path: Path) -> bytes | None:
    """The key in ``path`` if this user owns it, nobody else may read or write it, and it holds ``KEY_BYTES``."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as file:
        status = os.fstat(file.fileno())
        if status.st_uid != os.geteuid() or status.st_mode & 0o077:
            log.warning("neuron_compile: the signing key %s is not private to this user (owner %d, mode %o); "
                        "cached kernel code is not trusted, each kernel text is checked", path, status.st_uid,
                        status.st_mode & 0o777)
            return None
        key = file.read(KEY_BYTES + 1)
    return key if len(key) == KEY_BYTES else None


def create_private_key(path: Path) -> None:
    """Write a new random key to ``path``, whole or not at all: a racing process either links its file first or
    finds this one complete."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{KEY_FILE}-{os.getpid()}-{threading.get_ident()}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(os.urandom(KEY_BYTES))
        os.link(temporary, path)  # fails if another process made the key first: theirs is kept
    except FileExistsError:
        pass
    finally:
        os.unlink(temporary)


def signing_key() -> bytes | None:
    """This user's signing key (``key_path()``), made on first use; None when there is no private one to be had."""
    return signing_key_at(key_path())


@functools.cache
def signing_key_at(path: Path) -> bytes | None:
    """The key at ``path``, made when there is none; read once per process (a refusal is logged once)."""
    key = read_private_key(path)
    if key is None and not path.exists():
        try:
            create_private_key(path)
        except OSError as error:
            log.info("neuron_compile: no signing key could be made at %s (%s); kernel texts are checked on every "
                     "load", path, error)
            return None
        key = read_private_key(path)
    return key


def code_key_parts(source_text: str, filename: str, signer: str) -> dict:
    """The parts of a code entry's key: the text, what it compiles under, the bytecode format, our sources, signer."""
    return {
        "format": FORMAT,
        "what": WHAT,
        "kernel text": hashlib.sha256(source_text.encode()).hexdigest(),
        "filename": filename,
        "python": f"{sys.implementation.cache_tag} {importlib.util.MAGIC_NUMBER.hex()}",
        "neuron_compile": disk_cache.versions()["neuron_compile"],
        "signer": signer,
    }


def key_fingerprint(key: bytes) -> str:
    """The signer a key's entries are keyed by (a hash: the key itself is never written into the cache)."""
    return hashlib.sha256(key).hexdigest()[:16]


def code_tag(key: bytes, parts: dict, code_bytes: bytes) -> str:
    message = disk_cache.canonical_json(parts).encode() + b"\0" + code_bytes
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def verified_code(key: bytes, parts: dict, payload: dict) -> types.CodeType:
    """A code entry's code object; ``ValueError`` (a miss to ``DiskCache.lookup``) unless ``key`` made its tag."""
    try:
        code_bytes = base64.b64decode(payload["code"], validate=True)
        tag = payload["tag"]
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"a malformed kernel code entry ({error})") from None
    if not isinstance(tag, str) or not hmac.compare_digest(tag, code_tag(key, parts, code_bytes)):
        raise ValueError("a kernel code entry whose tag this user's signing key did not make")
    code = marshal.loads(code_bytes)  # only bytes this user's process wrote reach here
    if not isinstance(code, types.CodeType):
        raise ValueError("a kernel code entry that holds no code object")
    return code


def check_stored(parts: dict, payload: dict) -> None:
    """What ``neuron-compile cache verify`` checks of a code entry: one keyed by this user's signer must verify (one
    another key signed is never trusted here, so it is not this user's to judge)."""
    key = signing_key()
    if key is not None and parts.get("signer") == key_fingerprint(key):
        verified_code(key, parts, payload)


class SignedCodeCache:
    """Compiled kernel code in one ``DiskCache`` folder, trusted only under a valid tag (see the module docstring)."""

    def __init__(self, cache: disk_cache.DiskCache, key: bytes):
        self.cache = cache
        self.key = key
        self.signer = key_fingerprint(key)

    def key_parts(self, source_text: str, filename: str) -> dict:
        """The key parts of this text's code entry (``code_key_parts`` under this cache's signer)."""
        return code_key_parts(source_text, filename, self.signer)

    def lookup(self, parts: dict) -> types.CodeType | None:
        """The code stored under ``parts`` with a tag this user's key made, or None (absent, unsigned, forged)."""
        return self.cache.lookup(disk_cache.key_of(parts), lambda payload: verified_code(self.key, parts, payload))

    def store(self, parts: dict, code: types.CodeType) -> None:
        code_bytes = marshal.dumps(code)
        payload = {"code": base64.b64encode(code_bytes).decode("ascii"), "tag": code_tag(self.key, parts, code_bytes)}
        self.cache.store(disk_cache.key_of(parts), parts, payload)


def open_signed_code_cache(config: Config | None) -> SignedCodeCache | None:
    """The signed code of ``config``'s cache folder; None when the cache is off or this user has no private key."""
    cache = disk_cache.open_cache(config)
    if cache is None:
        return None
    key = signing_key()
    return SignedCodeCache(cache, key) if key is not None else None
