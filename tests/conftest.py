"""Test-run settings. The on-disk compile cache is off for every test (and every subprocess a test starts):
tests that count compiles must not see kernels an earlier test or run left on disk, and no test writes to the
user's home. Tests of the cache itself point NEURON_COMPILE_CACHE at a tmp_path."""

import os

os.environ["NEURON_COMPILE_CACHE"] = "off"
