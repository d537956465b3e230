"""Config: environment parsing, validation of options and values, patch() nesting."""

import pytest

from neuron_compile import config
from neuron_compile.config import Config


def test_defaults():
    defaults = Config()
    assert defaults.launcher == "auto"
    assert (defaults.fallback, defaults.target, defaults.cache_dir, defaults.dump_dir, defaults.bucket) == (
        "warn",
        "trn2",
        "",
        "",
        0,
    )


def test_from_env_reads_every_variable():
    environ = {
        "NEURON_COMPILE_FALLBACK": "RAISE",
        "NEURON_COMPILE_TARGET": "trn3",
        "NEURON_COMPILE_CACHE": "/c",
        "NEURON_COMPILE_DUMP": "/d",
        "NEURON_COMPILE_BUCKET": "128",
        "NEURON_COMPILE_RECOMPILE_WARN": "3",
        "NEURON_COMPILE_LAUNCHER": " Simulator ",
        "NEURON_COMPILE_FUSION": "0",
        "UNRELATED": "x",
    }
    assert Config.from_env(environ) == Config(
        fallback="raise", target="trn3", cache_dir="/c", dump_dir="/d", bucket=128, recompile_warn=3,
        launcher="simulator", fusion=False,
    )


def test_get_follows_environment(monkeypatch):
    monkeypatch.setenv("NEURON_COMPILE_FALLBACK", "silent")
    assert config.get().fallback == "silent"


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("NEURON_COMPILE_FALLBACK", "ignore", r"fallback must be one of \['warn', 'raise', 'silent'\], got 'ignore'"),
        ("NEURON_COMPILE_TARGET", "trn9", r"target must be one of .*'trn2'.*got 'trn9'"),
        ("NEURON_COMPILE_BUCKET", "lots", r"NEURON_COMPILE_BUCKET must be an integer, got 'lots'"),
        ("NEURON_COMPILE_BUCKET", "-1", r"bucket must be 0 \(off\) or a positive multiple to pad to, got -1"),
        ("NEURON_COMPILE_LAUNCHER", "gpu",
         r"launcher must be one of \['auto', 'simulator', 'device'\], got 'gpu'"),
    ],
)
def test_bad_environment_values_name_the_rule(variable, value, message):
    with pytest.raises(ValueError, match=message):
        Config.from_env({variable: value})


def test_replace_rejects_unknown_keys_naming_valid_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown neuron_compile option\(s\) \['fallbak'\]: valid options are "
        r"\['fallback', 'target'",
    ):
        Config().replace({"fallbak": "raise"})


def test_replace_rejects_bad_values():
    with pytest.raises(ValueError, match="fallback must be one of"):
        Config().replace({"fallback": "never"})
    with pytest.raises(ValueError, match="option 'bucket' must be an integer, got True"):
        Config().replace(bucket=True)
    with pytest.raises(ValueError, match="option 'target' must be a string, got int 2"):
        Config().replace(target=2)


def test_config_is_frozen_and_hashable():
    first, second = Config().replace(fallback="raise"), Config(fallback="raise")
    assert first == second and hash(first) == hash(second)
    with pytest.raises(AttributeError):
        first.fallback = "warn"


def test_patch_nests_and_restores(monkeypatch):
    monkeypatch.delenv("NEURON_COMPILE_FALLBACK", raising=False)
    with config.patch(fallback="raise") as outer:
        assert outer.fallback == "raise" == config.get().fallback
        with config.patch(target="trn1", fallback="silent"):
            assert (config.get().fallback, config.get().target) == ("silent", "trn1")
        assert (config.get().fallback, config.get().target) == ("raise", "trn2")
    assert config.get().fallback == "warn"


def test_patch_validates_before_entering():
    with pytest.raises(ValueError, match="unknown neuron_compile option"), config.patch(nonsense=1):
        pass
    assert config.get() == Config.from_env()


def test_directories_accept_paths(tmp_path):
    assert Config().replace(dump_dir=tmp_path, cache_dir=tmp_path / "cache") == Config(
        dump_dir=str(tmp_path), cache_dir=str(tmp_path / "cache")
    )
