"""Test-run settings. The on-disk compile cache is off for every test (and every subprocess a test starts):
tests that count compiles must not see kernels an earlier test or run left on disk, and no test writes to the
user's home. Tests of the cache itself point NEURON_COMPILE_CACHE at a tmp_path.

A ``Config`` built in a test (``Config(launcher="simulator")``) does not read the environment: its ``cache_dir``
is the default folder under ``XDG_CACHE_HOME``. That folder is a new empty one per test, so such a test neither
writes to the user's home nor finds what another test (or an earlier run) stored there. The signing key of the
cache's compiled kernel code (runtime/signed_code.py) lives under ``XDG_CONFIG_HOME``: a new folder per test too."""

import os

import pytest

os.environ["NEURON_COMPILE_CACHE"] = "off"


@pytest.fixture(autouse=True)
def default_cache_folder_per_test(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg-config")))
