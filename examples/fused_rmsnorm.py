"""A hand-written fused RMSNorm kernel inside a compiled transformers model.

The kernel is plain modern NKI; ``neuron_compile.nki_op`` makes it a torch operator, the model's RMSNorm modules
call it, and ``torch.compile(backend="neuron")`` launches it as a kernel of its own among the generated ones.
Here ``nki`` is the built-in simulator (on a Neuron host, ``import nki`` and the same kernel runs there).

Run: ``python examples/fused_rmsnorm.py`` — prints the model's error against eager and the cost figures with and
without the custom kernel, the gradient error of a compiled training step, and one kernel launch's cost report.
"""

from __future__ import annotations

import torch

import neuron_compile
from neuron_compile.runtime import simulator as nki
from neuron_compile.runtime.simulator import isa as nisa
from neuron_compile.runtime.simulator import language as nl

EPS = 1e-6


@nki.jit
def rmsnorm_kernel(x, weight):
    """out = x * rsqrt(mean(x**2, -1) + EPS) * weight for x [rows, cols], weight [cols]; one pass per row tile:
    ScalarE squares and sums the row in one instruction, VectorE applies both scales in one."""
    rows, cols = x.shape
    P = nl.tile_size.pmax
    out = nl.ndarray((rows, cols), dtype=x.dtype, buffer=nl.shared_hbm)
    # The weight broadcast over the partitions once (stride 0 on the partition axis), reused by every tile.
    weight_tile = nl.ndarray((P, cols), dtype=weight.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=weight_tile, src=weight.ap([[0, P], [1, cols]], 0))
    for start in range(0, rows, P):
        size = min(P, rows - start)  # a ragged last tile uses fewer partitions
        x_tile = nl.ndarray((P, cols), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_tile[:size], src=x[start:start + size, :])
        squares = nl.ndarray((P, cols), dtype=nl.float32, buffer=nl.sbuf)
        sum_squares = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=squares[:size], op=nl.square, data=x_tile[:size], reduce_op=nl.add,
                        reduce_res=sum_squares[:size])
        mean_eps = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=mean_eps[:size], data=sum_squares[:size], op0=nl.multiply, operand0=1.0 / cols,
                           op1=nl.add, operand1=EPS)
        inverse_rms = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=inverse_rms[:size], op=nl.rsqrt, data=mean_eps[:size])
        out_tile = nl.ndarray((P, cols), dtype=x.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=out_tile[:size], data=x_tile[:size], op0=nl.multiply,
                                  operand0=inverse_rms[:size], op1=nl.multiply, operand1=weight_tile[:size])
        nisa.dma_copy(dst=out[start:start + size, :], src=out_tile[:size])
    return out


def rmsnorm_backward(grad, x, weight):
    """The autograd formula, in torch (traced into the backward graph, compiled like any other ops)."""
    x32, grad32 = x.float(), grad.float()
    inverse_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    normed = x32 * inverse_rms
    grad_normed = grad32 * weight.float()
    grad_x = inverse_rms * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
    grad_weight = (grad32 * normed).reshape(-1, x.shape[-1]).sum(0)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


rmsnorm = neuron_compile.nki_op(rmsnorm_kernel, out=lambda x, weight: (x.shape, x.dtype), name="examples::rmsnorm",
                                backward=rmsnorm_backward)


class KernelRMSNorm(torch.nn.Module):
    """A drop-in for a transformers RMSNorm: the same weight, the hand-written kernel on 2-D rows."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight = norm.weight

    def forward(self, hidden_states):
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        return rmsnorm(rows, self.weight).reshape(hidden_states.shape)


def tiny_llama(seed: int = 0):
    """A random-weight two-layer Llama with eps matching the kernel's."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=EPS)
    return transformers.LlamaForCausalLM(config).eval()


def use_kernel_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every ``*RMSNorm`` module of ``model`` by a KernelRMSNorm over the same weight."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child).__name__.endswith("RMSNorm"):
                setattr(module, child_name, KernelRMSNorm(child))
    return model


def compiled_figures(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict, list]:
    """The compiled model's logits (second call: compiled, cached), its stats and its launches for that call."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="neuron", fullgraph=True)
    with torch.no_grad():
        compiled(input_ids)
        neuron_compile.reset_stats()
        with neuron_compile.record_launches() as launches:
            logits = compiled(input_ids).logits
    return logits, neuron_compile.stats(), list(launches)


def training_gradient_error(input_ids: torch.Tensor) -> tuple[float, dict]:
    """One training step through the kernel model, compiled and eager: the largest gradient difference, and the
    compiled step's stats."""
    gradients = []
    for compile_it in (False, True):
        torch._dynamo.reset()
        neuron_compile.reset_stats()
        model = use_kernel_norms(tiny_llama()).train()
        step = torch.compile(model, backend="neuron", fullgraph=True) if compile_it else model
        step(input_ids, labels=input_ids).loss.backward()
        gradients.append([parameter.grad for parameter in model.parameters()])
    error = max(float((compiled - eager).abs().max()) for eager, compiled in zip(*gradients, strict=True))
    return error, neuron_compile.stats()


def main() -> None:
    input_ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    reference = tiny_llama()
    with torch.no_grad():
        eager = reference(input_ids).logits
    variants = [("generated kernels only", tiny_llama()), ("with the rmsnorm kernel", use_kernel_norms(tiny_llama()))]
    for label, model in variants:
        logits, stats, launches = compiled_figures(model, input_ids)
        error = float((logits - eager).abs().max())
        user = [launch for launch in launches if launch.kernel == "examples_rmsnorm"]
        user_time = sum(launch.report.est_time_s for launch in user)
        print(f"{label}: max |logits - eager| {error:.2e}, {stats['kernels_launched']} kernels, "
              f"est {stats['est_time_s'] * 1e6:.1f} us, eager nodes {stats['fallback_nodes']}, "
              f"rmsnorm kernel launches {len(user)} ({user_time * 1e6:.1f} us)")
    error, stats = training_gradient_error(input_ids)
    print(f"training step with the rmsnorm kernel: max |grad compiled - grad eager| {error:.2e}, "
          f"{stats['kernels_launched']} kernels, eager nodes {stats['fallback_nodes']}")
    if user:
        print("\ncost report of one rmsnorm kernel launch:")
        print(user[0].report.format())


if __name__ == "__main__":
    main()
