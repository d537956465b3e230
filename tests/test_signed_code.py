"""Compiled kernel code in the on-disk cache, signed with the user's own key (runtime/signed_code.py, issue 11): a
later load takes the code without checking and compiling the text again; code nobody signed with this user's key
(forged, planted with another key, damaged) is never executed: the text is checked as before and a signed entry
written; without a private key nothing is signed or trusted."""

from __future__ import annotations

import base64
import hashlib
import json
import marshal
import os

import pytest
import torch
from lowering_harness import trace

import neuron_compile
from neuron_compile import cli
from neuron_compile.config import Config
from neuron_compile.pipeline import compile_region
from neuron_compile.runtime import disk_cache, launcher, signed_code
from neuron_compile.runtime.disk_cache import DiskCache


def two_kernels(t):
    return torch.softmax(t, -1).sum(0)


@pytest.fixture
def checks(monkeypatch):
    """The kernel texts the launcher checks (and so parses and compiles), in order."""
    checked = []
    real = launcher.check_kernel_text

    def counting(text, name):
        checked.append(name)
        return real(text, name)

    monkeypatch.setattr(launcher, "check_kernel_text", counting)
    return checked


def compiled_twice(tmp_path, checks, x):
    """A cold compile and a disk hit of ``two_kernels``; returns the cache and the region kernel's code entry key."""
    gm, config = trace(two_kernels, x), Config(cache_dir=str(tmp_path))
    compile_region(gm, [x], config)
    assert checks == ["region_kernel"]
    cache = DiskCache(tmp_path)
    (code_key,) = [info.key for info in cache.entries() if cache.read(info.key)["parts"]["what"] == signed_code.WHAT]
    return gm, config, cache, code_key


def test_a_disk_hit_runs_the_signed_code_without_checking_the_text_again(tmp_path, checks):
    x = torch.randn(130, 70)
    gm, config, cache, code_key = compiled_twice(tmp_path, checks, x)
    neuron_compile.reset_stats()
    warm = compile_region(gm, [x], config)
    assert checks == ["region_kernel"]  # the cold compile's check only
    torch.testing.assert_close(warm(x)[0], two_kernels(x))
    assert neuron_compile.stats()["disk_cache_hits"] == 1
    parts = cache.read(code_key)["parts"]
    assert parts["signer"] == signed_code.key_fingerprint(signed_code.signing_key())
    assert parts["python"].endswith(signed_code.importlib.util.MAGIC_NUMBER.hex())


def checksum(payload: dict) -> str:
    """An entry's checksum, as anyone who can write into a shared folder can compute it."""
    return hashlib.sha256(disk_cache.canonical_json(payload).encode()).hexdigest()


def forge(cache: DiskCache, key: str, code, sign_with: bytes) -> None:
    """Replace the entry's code with ``code``, tagged with ``sign_with``, under a valid checksum: what anyone who can
    write into the folder can do (only this user's key makes a tag that verifies)."""
    path = cache.entry_path(key)
    entry = json.loads(path.read_text())
    code_bytes = marshal.dumps(code)
    entry["payload"] = {"code": base64.b64encode(code_bytes).decode(),
                        "tag": signed_code.code_tag(sign_with, entry["parts"], code_bytes)}
    entry["checksum"] = checksum(entry["payload"])
    path.write_text(json.dumps(entry))


@pytest.mark.parametrize("signer", ["another key", "no tag"])
def test_code_this_users_key_did_not_sign_is_never_run(tmp_path, checks, signer):
    x = torch.randn(130, 70)
    gm, config, cache, code_key = compiled_twice(tmp_path, checks, x)
    marker = tmp_path / "marker"
    planted = compile(f"open({str(marker)!r}, 'w').close()", "<planted>", "exec")
    forge(cache, code_key, planted, os.urandom(signed_code.KEY_BYTES))
    if signer == "no tag":
        entry = json.loads(cache.entry_path(code_key).read_text())
        del entry["payload"]["tag"]
        entry["checksum"] = checksum(entry["payload"])
        cache.entry_path(code_key).write_text(json.dumps(entry))
    [(key, problem)] = cache.verify(lambda entry: signed_code.check_stored(entry["parts"], entry["payload"]))
    assert key == code_key and ("did not make" in problem or "malformed" in problem)
    neuron_compile.reset_stats()
    warm = compile_region(gm, [x], config)
    torch.testing.assert_close(warm(x)[0], two_kernels(x))
    assert not marker.exists()
    assert checks == ["region_kernel", "region_kernel"]  # checked again, as a text without signed code
    assert neuron_compile.stats()["disk_cache_corrupt"] == 1
    # rewritten under this user's tag: the next load takes it unchecked
    signed_code.check_stored(cache.read(code_key)["parts"], cache.read(code_key)["payload"])
    compile_region(gm, [x], config)
    assert checks == ["region_kernel", "region_kernel"] and not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not code"])
def test_a_damaged_code_entry_is_a_miss_that_is_rewritten(tmp_path, checks, damage):
    x = torch.randn(130, 70)
    gm, config, cache, code_key = compiled_twice(tmp_path, checks, x)
    path = cache.entry_path(code_key)
    if damage == "truncated":
        path.write_text(path.read_text()[:100])
    elif damage == "garbage":
        path.write_bytes(os.urandom(300))
    else:  # validly signed by this user's key, but a tuple, not code
        forge(cache, code_key, (1, 2), signed_code.signing_key())
    torch.testing.assert_close(compile_region(gm, [x], config)(x)[0], two_kernels(x))
    assert checks == ["region_kernel", "region_kernel"]
    compile_region(gm, [x], config)
    assert checks == ["region_kernel", "region_kernel"]


def test_without_a_private_key_nothing_is_signed_and_every_load_is_checked(tmp_path, checks):
    key_path = signed_code.key_path()
    assert signed_code.signing_key() is not None
    key_path.chmod(0o644)  # readable by others: not a secret any more
    signed_code.signing_key_at.cache_clear()
    try:
        assert signed_code.signing_key() is None
        x = torch.randn(130, 70)
        gm, config = trace(two_kernels, x), Config(cache_dir=str(tmp_path))
        compile_region(gm, [x], config)
        compile_region(gm, [x], config)
        assert checks == ["region_kernel", "region_kernel"]
        cache = DiskCache(tmp_path)
        assert [cache.read(info.key)["parts"]["what"] for info in cache.entries()] == [disk_cache.REGION_WHAT]
    finally:
        signed_code.signing_key_at.cache_clear()


def test_the_key_is_made_once_private_and_a_second_maker_keeps_it(tmp_path):
    path = tmp_path / "config" / "neuron_compile" / signed_code.KEY_FILE
    signed_code.create_private_key(path)
    first = path.read_bytes()
    signed_code.create_private_key(path)  # a racing process: the first key stays
    assert path.read_bytes() == first and len(first) == signed_code.KEY_BYTES
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert signed_code.read_private_key(path) == first
    assert sorted(p.name for p in path.parent.iterdir()) == [signed_code.KEY_FILE]  # no temporary file left
    path.write_bytes(first[:10])
    assert signed_code.read_private_key(path) is None  # a short key is no key
    link = tmp_path / "link"
    link.symlink_to(path)
    assert signed_code.read_private_key(link) is None  # never through a link


def test_code_keys_follow_the_text_the_file_name_and_the_signer():
    base = signed_code.code_key_parts("text", "<nki-kernel k>", "a")
    assert base["neuron_compile"] == disk_cache.versions()["neuron_compile"]  # a changed checker is a new key
    others = [signed_code.code_key_parts("text2", "<nki-kernel k>", "a"),
              signed_code.code_key_parts("text", "<nki-kernel j>", "a"),
              signed_code.code_key_parts("text", "<nki-kernel k>", "b")]
    assert len({disk_cache.key_of(parts) for parts in [base, *others]}) == 4


def test_cache_verify_reports_forged_code(tmp_path, checks, capsys):
    x = torch.randn(130, 70)
    _, _, cache, code_key = compiled_twice(tmp_path, checks, x)
    forge(cache, code_key, compile("pass", "<planted>", "exec"), os.urandom(signed_code.KEY_BYTES))
    capsys.readouterr()
    assert cli.main(["cache", "--dir", str(tmp_path), "verify"]) == 1
    out = capsys.readouterr().out
    assert f"{code_key}: a kernel code entry whose tag this user's signing key did not make" in out
    assert cli.main(["cache", "--dir", str(tmp_path), "show", code_key[:10]]) == 0
    assert "what: kernel code" in capsys.readouterr().out
