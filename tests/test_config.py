"""Config: environment parsing, validation of options and values, patch() nesting."""

import pytest

from neuron_compile import config
from neuron_compile.config import Config


def test_defaults():
    defaults = Config()
    assert defaults.launcher == "auto" and defaults.launch_unit == "region"
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
        "NEURON_COMPILE_LAUNCH_UNIT": "Kernel",
        "UNRELATED": "x",
    }
    assert Config.from_env(environ) == Config(
        fallback="raise", target="trn3", cache_dir="/c", dump_dir="/d", bucket=128, recompile_warn=3,
        launcher="simulator", fusion=False, launch_unit="kernel",
    )


def test_get_follows_environment(monkeypatch):
    monkeypatch.setenv("NEURON_COMPILE_FALLBACK", "silent")
    assert config.get().fallback == "silent"


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("NEURON_COMPILE_FALLBACK", "ignore",
         r"^NEURON_COMPILE_FALLBACK must be one of \['warn', 'raise', 'silent'\], got 'ignore'$"),
        ("NEURON_COMPILE_TARGET", "trn9", r"^NEURON_COMPILE_TARGET must be one of \['trn1', .*'trn2'.*\], got 'trn9'$"),
        ("NEURON_COMPILE_BUCKET", "lots", r"^NEURON_COMPILE_BUCKET must be an integer, got 'lots'$"),
        ("NEURON_COMPILE_BUCKET", "-1", r"^NEURON_COMPILE_BUCKET must be 0 \(off\) or a positive multiple to pad to, "
                                        r"got -1$"),
        ("NEURON_COMPILE_LAUNCHER", "gpu",
         r"^NEURON_COMPILE_LAUNCHER must be one of \['auto', 'simulator', 'device'\], got 'gpu'$"),
        ("NEURON_COMPILE_LAUNCH_UNIT", "graph",
         r"^NEURON_COMPILE_LAUNCH_UNIT must be one of \['region', 'kernel'\], got 'graph'$"),
        ("NEURON_COMPILE_FUSION", "maybe",
         r"^NEURON_COMPILE_FUSION must be a boolean \(1/0, true/false, on/off\), got 'maybe'$"),
        ("NEURON_COMPILE_CACHE_SIZE", "big",
         r"^NEURON_COMPILE_CACHE_SIZE must be a size in bytes \(e.g. 1073741824, 512M, 2G\), got 'big'$"),
        ("NEURON_COMPILE_RECOMPILE_WARN", "0", r"^NEURON_COMPILE_RECOMPILE_WARN must be an integer >= 1, got 0$"),
        ("NEURON_COMPILE_RECOMPILE_WARN", "often", r"^NEURON_COMPILE_RECOMPILE_WARN must be an integer, got 'often'$"),
    ],
)
def test_bad_environment_values_name_the_variable_and_the_valid_values(variable, value, message):
    with pytest.raises(ValueError, match=message):
        Config.from_env({variable: value})


def test_every_config_field_has_a_variable_that_is_validated():
    # the directories take any path; every other variable rejects a word no field accepts, naming itself
    for variable in config.ENV_VARIABLES:
        if variable in ("NEURON_COMPILE_CACHE", "NEURON_COMPILE_DUMP"):
            continue
        with pytest.raises(ValueError, match=f"^{variable} must be "):
            Config.from_env({variable: "nonsense-value"})


def test_unknown_variable_with_our_prefix_warns_naming_the_valid_ones():
    with pytest.warns(UserWarning, match="NEURON_COMPILE_FALBACK is not a neuron_compile variable .*"
                                         "NEURON_COMPILE_FALLBACK, NEURON_COMPILE_TARGET"):
        assert Config.from_env({"NEURON_COMPILE_FALBACK": "raise"}) == Config()


def test_replace_rejects_unknown_keys_naming_valid_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown neuron_compile option\(s\) \['fallbak'\]: valid options are "
        r"\['fallback', 'target'",
    ):
        Config().replace({"fallbak": "raise"})


def test_replace_rejects_bad_values():
    with pytest.raises(ValueError,
                       match=r"^option 'fallback' must be one of \['warn', 'raise', 'silent'\], got 'never'$"):
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
