"""Log topics: NEURON_COMPILE_LOGS parsing and validation, what a topic turns on, torch._logging registration."""

import contextlib
import logging
import os
import subprocess
import sys

import pytest
import torch

import neuron_compile
from neuron_compile import config, logs
from neuron_compile.config import Config

DISPATCH_LOGGER = "neuron_compile.runtime.compiled_graph"


@contextlib.contextmanager
def captured(caplog, name: str):
    """caplog's handler on logger ``name`` itself: torch._logging may have turned propagation to the root (where
    caplog listens) off for the loggers it manages; the levels are restored afterwards."""
    logger = logging.getLogger(name)
    levels = {each: logging.getLogger(each).level for each in (name, logs.ROOT)}
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        for each, level in levels.items():
            logging.getLogger(each).setLevel(level)
        logs.forget_applied()


def test_parse_maps_topics_to_module_loggers_and_levels():
    assert logs.parse("+dispatch, cache,-backend") == {
        DISPATCH_LOGGER: logging.DEBUG, "neuron_compile.runtime.region_module": logging.DEBUG,
        "neuron_compile.runtime.disk_cache": logging.INFO, "neuron_compile.runtime.report_cache": logging.INFO,
        "neuron_compile.runtime.warm_candidate": logging.INFO, "neuron_compile.runtime.warm_start": logging.INFO,
        "neuron_compile.backend": logging.ERROR, "neuron_compile.trace_compile": logging.ERROR,
    }
    assert logs.parse("") == {}
    assert logs.parse("+all") == {"neuron_compile": logging.DEBUG}


def test_bad_setting_names_the_variable_and_the_topics():
    with pytest.raises(ValueError, match=r"^NEURON_COMPILE_LOGS must be a comma-separated list of \['all', "
                                         r"'backend', 'bucket', 'cache', 'dispatch', 'partition'\].*got '\+dispach'"):
        Config.from_env({"NEURON_COMPILE_LOGS": "+dispach"})
    with pytest.raises(ValueError, match="^option 'logs' must be"):
        Config().replace(logs="everything")


def test_dispatch_topic_logs_each_signature_compiled(caplog):
    compiled = torch.compile(lambda x: torch.relu(x) * 2, backend="neuron", dynamic=True)
    with config.patch(logs="+dispatch", cache_dir="off"), captured(caplog, DISPATCH_LOGGER):
        compiled(torch.randn(3, 4))
        compiled(torch.randn(5, 4))
        compiled(torch.randn(5, 4))  # a hit: nothing logged
    records = {id(record): record for record in caplog.records if record.name == DISPATCH_LOGGER}  # root + ours
    lines = [record.getMessage() for record in records.values()]
    assert len(lines) == 2, lines
    assert "for signature 1: " in lines[0] and "3x4 float32" in lines[0]
    assert "for signature 2: " in lines[1] and "5x4 float32" in lines[1]


def test_without_the_topic_nothing_is_logged_below_warning(caplog):
    compiled = torch.compile(lambda x: x + 1, backend="neuron")
    with config.patch(cache_dir="off"), captured(caplog, DISPATCH_LOGGER):
        logging.getLogger(DISPATCH_LOGGER).setLevel(logging.WARNING)
        compiled(torch.randn(2, 2))
    assert not [record for record in caplog.records if record.name == DISPATCH_LOGGER]


def test_registered_with_torch_logging():
    assert neuron_compile.logs is logs
    registry = torch._logging._internal.log_registry
    assert registry.log_alias_to_log_qnames["neuron_compile"] == ["neuron_compile"]
    try:
        torch._logging.set_logs(modules={"neuron_compile.runtime.disk_cache": logging.DEBUG})
        assert logging.getLogger("neuron_compile.runtime.disk_cache").getEffectiveLevel() == logging.DEBUG
        torch._logging.set_logs(modules={"neuron_compile": logging.INFO})
        assert logging.getLogger(DISPATCH_LOGGER).getEffectiveLevel() == logging.INFO
    finally:
        torch._logging.set_logs()  # back to torch's defaults
        logging.getLogger(logs.ROOT).propagate = True


def test_torch_logs_prints_each_record_once():
    script = "import torch, neuron_compile; torch.compile(lambda x: x * 2, backend='neuron')(torch.ones(3))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True,
                          env={**os.environ, "TORCH_LOGS": "+neuron_compile", "NEURON_COMPILE_CACHE": "off"})
    lines = [line for line in done.stderr.splitlines() if "compiled the inference graph" in line]
    assert len(lines) == 1, done.stderr[-2000:]
