"""`neuron-compile dump | explain | profile` on small torch scripts written to a tmp folder: a tiny MLP with a graph
break (a print between its layers), an eager fallback (torch.sort) and a recompile (a second batch size); a
script that raises; usage errors. Each command runs once per module, in-process through cli.main."""

from __future__ import annotations

import collections
import contextlib
import html.parser
import io
import json
import re
import shutil
import subprocess
import textwrap

import pytest

from neuron_compile import cli

MLP_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch


    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(16, 64)
            self.down = torch.nn.Linear(64, 8)

        def forward(self, x):
            h = torch.relu(self.up(x))
            print("hidden", tuple(h.shape))
            return torch.sort(self.down(h), dim=-1).values


    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="neuron")
    with torch.no_grad():
        for rows in [int(arg) for arg in sys.argv[1:]]:
            x = torch.randn(rows, 16)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    print("checked against eager")
    """
)

FAILING_SCRIPT = textwrap.dedent(
    """
    def helper(value):
        raise ValueError(f"bad value {value}")


    helper(41 + 1)
    """
)


@contextlib.contextmanager
def captured():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


def run_cli(*argv: str) -> tuple[int, str, str]:
    with captured() as (out, err):
        status = cli.main(list(argv))
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def mlp_script(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("scripts") / "tiny_mlp.py"
    path.write_text(MLP_SCRIPT)
    return str(path)


@pytest.fixture(scope="module")
def dumped(mlp_script, tmp_path_factory):
    out = tmp_path_factory.mktemp("dump") / "dump"
    status, stdout, stderr = run_cli("dump", mlp_script, "4", "6", "--out", str(out))  # --out last, as the synopsis
    return status, stdout, stderr, out


def test_dump_runs_the_script_with_its_arguments(dumped):
    status, stdout, stderr, _ = dumped
    assert status == 0, stderr
    # each batch size: the compiled model's print, then eager's
    assert stdout.splitlines() == ["hidden (4, 64)"] * 2 + ["hidden (6, 64)"] * 2 + ["checked against eager"]
    assert "4 Dynamo graph(s)" in stderr and "2 graph break(s), 2 recompile(s)" in stderr
    assert stderr.count("neuron_compile: dumped the inference graph to ") == 4  # progress, one line per graph


def test_dump_index_lists_graphs_recompiles_and_graph_breaks(dumped, mlp_script):
    *_, out = dumped
    index = json.loads((out / "index.json").read_text())
    assert [graph["ended_by"] for graph in index["graphs"]] == ["graph break", "end of frame"] * 2
    assert [graph["function"] for graph in index["graphs"]][:2] == ["forward", "torch_dynamo_resume_in_forward_at_14"]
    (graph_break,) = index["graph_breaks"]
    assert graph_break["source"] == f'{mlp_script}:14: print("hidden", tuple(h.shape))' and graph_break["count"] == 2
    assert "builtin operator `print`" in graph_break["reason"] and "http" not in graph_break["reason"]
    guards = [recompile["guard"] for recompile in index["recompiles"]]
    assert guards == ["0/0: tensor 'x' size mismatch at index 0. expected 4, actual 6",
                      "1/0: tensor 'h' size mismatch at index 0. expected 4, actual 6"]
    index_text = (out / "index.txt").read_text()
    assert "2 recompile(s)" in index_text and "2 graph break(s) at 1 place(s)" in index_text


def test_dump_writes_every_stage_of_a_graph(dumped):
    *_, out = dumped
    assert "torch.relu" in (out / "graph_000" / "dynamo_fx.txt").read_text()
    (folder,) = (out / "graph_001").glob("inference-*")
    assert "aten.sort.default" in (folder / "aten_graph.txt").read_text()
    partition = (folder / "partition.txt").read_text()
    assert "nki_region_0" in partition and "eager: no lowering for aten.sort.default" in partition
    passes = sorted(path.name for path in (folder / "passes").iterdir())
    assert [re.sub(r"^\d\d-", "", name) for name in passes] == [
        "specialize.txt", "bound_inputs.txt", "complex_pairs.txt", "flex_attention.txt", "attention_pattern.txt",
        "split_projections.txt", "partition.txt",
        "lower.nki_region_0.txt",
        "guard_ranges.nki_region_0.txt",
        "fuse.nki_region_0.txt", "plan_tiles.nki_region_0.txt", "render.nki_region_0.txt", "load.nki_region_0.txt"]
    assert "MatMul" in (folder / "fusion.txt").read_text()
    assert "matmul_kernel_0:" in (folder / "tile_plans.txt").read_text()
    costs = (folder / "costs.txt").read_text()
    assert costs.startswith("== nki_region_0.matmul_kernel_0: est ") and "bottleneck" in costs
    assert "cost report (trn2)" in costs


def test_dumped_kernel_runs_under_simulate(dumped):
    *_, out = dumped
    (kernel,) = out.glob("graph_001/inference-*/kernels/nki_region_0.matmul_kernel_0.py")
    status, stdout, stderr = run_cli("simulate", "--report", str(kernel))
    assert status == 0, stderr
    assert stdout.startswith("matmul_kernel_0: float32[")
    report = stdout.split("== launch 1\n", 1)[1]
    (costs,) = out.glob("graph_001/inference-*/costs.txt")
    # the same kernel on made-up inputs of the same sizes costs what its launch in the graph cost
    assert report.splitlines()[:4] == costs.read_text().splitlines()[1:5]


def test_dump_replaces_a_previous_dump_but_not_other_files(dumped, mlp_script, tmp_path):
    *_, out = dumped
    (tmp_path / "notes.txt").write_text("mine")
    status, _, stderr = run_cli("dump", "--out", str(tmp_path), mlp_script)
    assert status == 2 and "not empty and not a previous dump" in stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.fixture(scope="module")
def explained(mlp_script):
    # the same script as the dump's: each command starts from a fresh Dynamo state, as a new process would
    return (*run_cli("explain", mlp_script, "4", "6"), mlp_script)


def test_explain_reports_breaks_recompiles_fallbacks_and_kernels(explained):
    status, stdout, stderr, mlp_script = explained
    assert status == 0, stderr
    report = stdout.split("neuron-compile explain: ", 1)[1]
    assert f'== graph breaks: 2\n  {mlp_script}:14: print("hidden", tuple(h.shape))  (2x)\n' in report
    assert "== recompiles: 2 by Dynamo" in report
    assert "guard failed: 0/0: tensor 'x' size mismatch at index 0. expected 4, actual 6" in report
    fallbacks = "== eager fallbacks: 2 ATen node(s)\n     2  no lowering for aten.sort.default: aten.sort.default x2"
    assert fallbacks in report
    kernels = report.split("== kernels by estimated time: ", 1)[1].splitlines()
    assert kernels[0].startswith("4 kernel(s), 4 launch(es)")
    rows = [line.split() for line in kernels[2:]]
    assert [row[0] for row in rows] == ["1", "2", "3", "4"]
    times = [float(row[5]) for row in rows]
    assert times == sorted(times, reverse=True)
    assert all(row[-1] in ("dma", "tensor", "vector", "scalar") for row in rows)
    assert {row[1] for row in rows} == {"graph_000", "graph_001", "graph_002", "graph_003"}


def test_failing_script_shows_its_traceback_and_exits_1(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILING_SCRIPT)
    status, stdout, stderr = run_cli("explain", str(script))
    assert status == 1
    assert stderr.startswith("Traceback (most recent call last):\n  File \"" + str(script))  # the script's frames only
    assert "ValueError: bad value 42" in stderr and "raised ValueError (exit status 1)" in stderr
    assert "== graph breaks: 0" in stdout  # the report is still printed


@pytest.mark.parametrize("argv, message", [
    (["dump", "SCRIPT"], "--out DIR is required"),
    (["explain", "missing.py"], "no such script: missing.py"),
    (["profile", "SCRIPT", "--out", "no/such/folder/report.html"], "give an HTML file path in an existing folder"),
])
def test_usage_errors_exit_2_and_say_what_to_do(argv, message, mlp_script):
    status, _, stderr = run_cli(*[mlp_script if arg == "SCRIPT" else arg for arg in argv])
    assert status == 2 and message in stderr


def test_invalid_environment_variable_is_a_usage_error(mlp_script, monkeypatch):
    monkeypatch.setenv("NEURON_COMPILE_FALLBACK", "loud")
    status, _, stderr = run_cli("explain", mlp_script)
    assert status == 2
    assert "NEURON_COMPILE_FALLBACK" in stderr and "'warn'" in stderr and "'loud'" in stderr


def test_every_subcommand_has_help():
    for command in ("dump", "explain", "profile", "simulate", "cache"):
        with captured() as (out, _), pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--help"])
        assert exit_info.value.code == 0 and out.getvalue().startswith(f"usage: neuron-compile {command}")


class PageParser(html.parser.HTMLParser):
    """The profile page's structure: kernel sections, each one's lanes and boxes, every tag and attribute."""

    def __init__(self):
        super().__init__()
        self.tags: list[str] = []
        self.attribute_values: list[str] = []
        self.kernels: list[dict] = []  # {"label", "lanes": [queue], "box_ends": [x + width]}
        self.graph_tables: list[str] = []

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        self.tags.append(tag)
        self.attribute_values += [value or "" for value in attributes.values()]
        if tag == "section" and attributes.get("class") == "kernel":
            self.kernels.append({"label": attributes["data-kernel"], "lanes": [], "box_ends": []})
        elif tag == "table" and attributes.get("class") == "graph":
            self.graph_tables.append(attributes["data-graph"])
        elif tag == "g" and attributes.get("class") == "lane-row":
            self.kernels[-1]["lanes"].append(attributes["data-queue"])
        elif tag == "rect" and attributes.get("class", "").startswith("q-") and self.kernels:
            self.kernels[-1]["box_ends"].append(float(attributes["x"]) + float(attributes["width"]))


@pytest.fixture(scope="module")
def profiled(mlp_script, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "report.html"
    status, stdout, stderr = run_cli("profile", "--out", str(out), mlp_script, "4", "6")
    return status, stderr, out


def test_profile_page_has_a_timeline_per_kernel_and_nothing_external(profiled):
    from neuron_compile import profile_page

    status, stderr, out = profiled
    assert status == 0, stderr
    text = out.read_text()
    summary = "4 kernel launch(es) of 4 kernel(s) in 4 ATen graph compile(s); 2 graph break(s), 2 eager ATen node(s)"
    assert summary in text
    page = PageParser()
    page.feed(text)
    # one section per kernel launched: the four graphs (two Dynamo graphs, each compiled for batch 4 and 6)
    assert sorted(kernel["label"] for kernel in page.kernels) == [
        f"graph_00{index} inference nki_region_0.matmul_kernel_0" for index in range(4)]
    assert page.graph_tables == [f"graph_00{index} inference" for index in (0, 1, 2, 3)]
    known = {queue for queue, _ in profile_page.LANES}
    for kernel in page.kernels:
        assert {"tensor", "vector", "dma_load", "dma_store"} <= set(kernel["lanes"]) <= known, kernel
        # the latest box ends where the time axis ends: the schedule's makespan spans the timeline
        assert max(kernel["box_ends"]) == pytest.approx(profile_page.LABEL_WIDTH + profile_page.WIDTH, abs=0.2)
    # self-contained: no script, no stylesheet link, no image or frame source, no web address anywhere
    assert not {"script", "link", "img", "iframe", "object"} & set(page.tags)
    assert not re.search(r"https?:|//[a-z]", text, flags=re.IGNORECASE)
    assert not any(value.startswith(("http", "//", "file:")) for value in page.attribute_values)


# Headless Chromium (Debian's `chromium` package; .ci/run installs it): every host name resolves to nothing, so a
# page that needed the network would show it; no background traffic of the browser's own.
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-extensions",
                  "--host-resolver-rules=MAP * ~NOTFOUND")
SWATCH_PIXELS = 10 * 10  # a lane's legend swatch: the only place a lane's colour shows when no kernel uses it


def chromium(*arguments: str) -> str:
    done = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, *arguments], capture_output=True, text=True, timeout=120,
                          check=True)
    return done.stdout


def lane_colours() -> dict[str, tuple[int, int, int]]:
    """Each lane's box colour, as the page's stylesheet paints it (``.q-tensor { fill: #4a78c2; }``)."""
    from neuron_compile import profile_page

    found = re.findall(r"\.q-(\w+) \{ fill: #([0-9a-f]{6}); \}", profile_page.STYLE)
    return {queue: tuple(int(code[i:i + 2], 16) for i in (0, 2, 4)) for queue, code in found}


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)")
def test_profile_page_in_headless_chromium_shows_every_kernel_timeline(profiled, tmp_path):
    Image = pytest.importorskip("PIL.Image")
    from neuron_compile import profile_page

    status, stderr, out = profiled
    assert status == 0, stderr
    source = PageParser()
    source.feed(out.read_text())
    # The browser's document, after it parsed the page offline, holds every kernel section, lane and box the page
    # was written with: nothing it rejected or moved.
    rendered = PageParser()
    rendered.feed(chromium("--dump-dom", out.as_uri()))
    assert rendered.kernels == source.kernels and rendered.graph_tables == source.graph_tables
    # What it paints: each lane a kernel has shows its boxes, beyond the legend swatch; a lane no kernel has
    # shows only its swatch.
    screenshot = tmp_path / "report.png"
    chromium("--window-size=1280,9000", f"--screenshot={screenshot}", out.as_uri())
    pixels = collections.Counter({colour: count for count, colour in
                                  Image.open(screenshot).convert("RGB").getcolors(maxcolors=1 << 24)})
    used = {queue for kernel in source.kernels for queue in kernel["lanes"]}
    colours = lane_colours()
    assert set(colours) == {queue for queue, _ in profile_page.LANES}
    for queue, colour in colours.items():
        if queue in used:
            assert pixels[colour] > 4 * SWATCH_PIXELS, (queue, pixels[colour])
        else:
            assert pixels[colour] == SWATCH_PIXELS, (queue, pixels[colour])
