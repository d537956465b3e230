"""A separate process for tests/test_warm_start.py: compiles one small graph (a CASE) with backend="neuron" under the
NEURON_COMPILE_CACHE it is given, calls it, and prints one JSON line: each call's largest difference from eager, a
hash of the compiled outputs' bytes, the inputs' version counters after each call, how many times aot_autograd traced,
the compiler's modules imported by then, and the stats.

With ``WARM_CHILD_FAIL_LAUNCH`` set, every kernel launch fails. ``python warm_start_child.py CASE`` runs one case (``generate``: a tiny Llama's ``generate()`` with a static cache); ``python warm_start_child.py all`` runs every case in turn (with
``torch._dynamo.reset()`` between them), as the first process that fills a cache for the others does.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

import neuron_compile


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))


def accepted_case():
    """One NKI region, nothing mutated, no output aliasing: the fast path's case."""
    model = mlp()

    def forward(x):
        y = model(x)
        return y, torch.softmax(y, dim=-1).sum(-1)

    inputs = [(torch.randn(16, 64),), (torch.randn(16, 64),)]
    return forward, inputs, torch.no_grad


def constant_and_order_case():
    """A constant in aot_autograd's graph (an empty tensor, as transformers' first cache write cats onto) and outputs
    in another order than the region's."""
    model = mlp()

    def forward(x):
        first = torch.relu(x) + 1.0
        second = torch.cat([torch.tensor([]), model(x).reshape(-1)])
        return second, first

    return forward, [(torch.randn(16, 64),), (torch.randn(16, 64),)], torch.no_grad


def bounds_case():
    """Integer math under the input-range guard: the second call's values leave the first call's bound, so its
    dispatch key is another (Dynamo's guards do not see values)."""

    def forward(ids, x):
        return (ids * 3 + 1).to(torch.float32) * x,

    small = torch.arange(12).reshape(3, 4)
    inputs = [(small, torch.randn(3, 4)), (small + 2**22, torch.randn(3, 4))]
    return forward, inputs, torch.no_grad


def cache_write(cache, position, x):
    cache.index_copy_(0, position, x)
    return cache * 2.0,


def cache_inputs() -> list:
    return [(torch.zeros(8, 16), torch.tensor([2]), torch.randn(1, 16)),
            (torch.zeros(8, 16), torch.tensor([5]), torch.randn(1, 16))]


def cache_write_case():
    """An input written in place under no_grad (a static cache's ``index_copy_``): aot_autograd keeps the write in its
    graph and hides it from autograd, our region writes the input."""
    return cache_write, cache_inputs(), torch.no_grad


def cache_write_with_grad_case():
    """The same write with grad enabled (no input requires grad: still an inference graph): autograd sees the write,
    and aot_autograd's wrapper bumps the input's version counter."""
    return cache_write, cache_inputs(), torch.enable_grad


def metadata_mutation_case():
    """A transpose in place of an input: Dynamo applies it outside its graph (aot_autograd sees no mutation)."""

    def forward(x):
        x.t_()
        return x * 2.0,

    return forward, [(torch.randn(8, 16),), (torch.randn(8, 16),)], torch.no_grad


def alias_input_case():
    def forward(x):
        return x.view(-1), x * 2.0

    return forward, [(torch.randn(8, 16),), (torch.randn(8, 16),)], torch.no_grad


def alias_intermediate_case():
    def forward(x):
        y = torch.relu(x) * 3.0
        return y, y.view(-1)

    return forward, [(torch.randn(8, 16),), (torch.randn(8, 16),)], torch.no_grad


def training_case():
    """Grad enabled and the weights require grad: aot_autograd makes forward and backward graphs."""
    model = mlp()

    def forward(x):
        return (model(x) ** 2).mean(),

    return forward, [(torch.randn(16, 64),), (torch.randn(16, 64),)], torch.enable_grad


def dynamic_case():
    model = mlp()

    def forward(x):
        return model(x),

    return forward, [(torch.randn(16, 64),), (torch.randn(24, 64),)], torch.no_grad


CASES = {
    "accepted": accepted_case, "constant_and_order": constant_and_order_case, "bounds": bounds_case, "cache_write": cache_write_case,
    "cache_write_with_grad": cache_write_with_grad_case, "metadata_mutation": metadata_mutation_case, "alias_input": alias_input_case,
    "alias_intermediate": alias_intermediate_case, "training": training_case, "dynamic": dynamic_case,
}


# Modules of the compiler a warm start has no use for (it runs stored kernels): their import is what it saves.
COMPILER_MODULES = ("neuron_compile.trace_compile", "neuron_compile.pipeline", "neuron_compile.lowering",
                    "neuron_compile.passes.fusion", "neuron_compile.kinds", "neuron_compile.codegen.render")


def compiler_imported() -> list:
    return sorted(name for name in COMPILER_MODULES if name in sys.modules)


def count_aot_traces() -> list:
    """Count aot_autograd's traces (the backend's ``aot_autograd`` calls ``aot_module_simplified`` from here)."""
    from torch._dynamo.backends import common

    traced = []
    real = common.aot_module_simplified

    def counted(*args, **kwargs):
        traced.append(1)
        return real(*args, **kwargs)

    common.aot_module_simplified = counted
    return traced


def run(case: str, traced: list) -> dict:
    torch.manual_seed(1)
    forward, calls, grad_mode = CASES[case]()
    compiled = torch.compile(forward, backend="neuron", dynamic=True if case == "dynamic" else None)
    differences, digest, versions = [], hashlib.sha256(), []
    for arguments in calls:
        eager_arguments = [argument.clone() for argument in arguments]
        with grad_mode():
            expected = forward(*eager_arguments)
            actual = compiled(*arguments)
        for got, want in zip(actual, expected, strict=True):
            differences.append(float((got.detach() - want.detach()).abs().max()))
            digest.update(got.detach().contiguous().numpy().tobytes())
        differences += [float((got - want).abs().max()) for got, want in zip(arguments, eager_arguments, strict=True)]
        versions += [argument._version for argument in arguments]
    stats = {name: value for name, value in neuron_compile.stats().items() if isinstance(value, int)}
    return {"case": case, "differences": differences, "outputs": digest.hexdigest(), "versions": versions,
            "aot_traces": len(traced), "compiler_imported": compiler_imported(), "stats": stats}


def generate(traced: list) -> dict:
    """``generate()`` with a static cache on a tiny Llama (random weights), compiled as transformers does it: the tokens
    and whether they equal eager's."""
    import warnings

    import transformers

    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    compile_config = transformers.CompileConfig(backend="neuron", fullgraph=False, dynamic=False)
    compile_config._compile_all_devices = True  # transformers compiles the step on CPU tensors only with this
    tokens = {}
    for name, extra in (("eager", {}), ("compiled", {"compile_config": compile_config})):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokens[name] = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static",
                                          **extra).tolist()
    stats = {name: value for name, value in neuron_compile.stats().items() if isinstance(value, int)}
    return {"case": "generate", "tokens": tokens["compiled"], "equal": tokens["compiled"] == tokens["eager"],
            "aot_traces": len(traced), "stats": stats}


def fail_every_launch() -> None:
    """Every kernel launch raises, as a kernel that fails on the device would: regions fall back eagerly."""
    from neuron_compile.runtime import launcher

    def fail(self, kernel, arguments):
        raise RuntimeError("launch refused by the test")

    launcher.SimulatorLauncher.launch = fail


def main() -> None:
    traced = count_aot_traces()
    if os.environ.get("WARM_CHILD_FAIL_LAUNCH"):
        fail_every_launch()
    names = list(CASES) if sys.argv[1] == "all" else [sys.argv[1]]
    results = {}
    for name in names:
        torch._dynamo.reset()
        neuron_compile.reset_stats()
        traced.clear()
        results[name] = generate(traced) if name == "generate" else run(name, traced)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
