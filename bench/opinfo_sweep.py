"""OpInfo sweep: every entry of torch's op_db through backend="neuron" vs eager, float32 and bfloat16 on CPU.

For each op and dtype we take the first ``--samples`` sample inputs, run the op eagerly and compiled (fresh
Dynamo state per op, so the recompile limit never turns later ops silently eager), and classify the op:

- correct: every sample that eager runs gives the same result compiled (NaN-equal, dtype tolerances below;
  for bf16, a result off eager but no further from a float64 reference than eager's own is accepted and
  listed; the empty* ops return uninitialized memory, so only their shape, dtype and strides are compared);
- fully lowered: every ATen node of every sample ran in NKI kernels; partly: some did; not at all: none did;
  no ATen node: nothing reached the backend (the op is an alias or a random op, or Dynamo broke the graph) — counted
  in the total, never as lowered.

Random ops are wrapped in ``wrapper_set_seed`` upstream, which Dynamo cannot trace: we call the op directly
and seed before both runs. Prints one table and the top fallback reasons.

    .venv/bin/python bench/opinfo_sweep.py                    # the whole corpus (slow: tens of minutes)
    .venv/bin/python bench/opinfo_sweep.py --ops add,mm,softmax --samples 2
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import warnings

import torch

# op_db needs expecttest (test extra); importing it also pulls in torch's test utilities.
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

import neuron_compile  # noqa: E402

# bf16 (op names) whose result differed from eager but was at least as close to a float64 reference.
accepted_by_reference: set[str] = set()

TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _flatten(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _flatten(item)]
    if hasattr(value, "_fields"):  # namedtuple-like returns (torch.return_types)
        return [t for item in tuple(value) for t in _flatten(item)]
    return []


def _same(expected, actual, dtype) -> str | None:
    expected_tensors, actual_tensors = _flatten(expected), _flatten(actual)
    if len(expected_tensors) != len(actual_tensors):
        return f"returned {len(actual_tensors)} tensors, eager {len(expected_tensors)}"
    for want, got in zip(expected_tensors, actual_tensors):
        try:
            if want.is_floating_point() or want.is_complex():
                torch.testing.assert_close(got, want, equal_nan=True, **TOLERANCES[dtype])
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        except AssertionError as error:
            return str(error).splitlines()[0]
    return None


# Ops whose outputs are uninitialized memory in eager too: only shape, dtype and strides can be compared.
UNINITIALIZED_OUTPUT = ("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided")


def _same_metadata(expected, actual) -> str | None:
    expected_tensors, actual_tensors = _flatten(expected), _flatten(actual)
    if len(expected_tensors) != len(actual_tensors):
        return f"returned {len(actual_tensors)} tensors, eager {len(expected_tensors)}"
    for want, got in zip(expected_tensors, actual_tensors):
        if (got.shape, got.dtype, got.stride()) != (want.shape, want.dtype, want.stride()):
            return f"metadata {got.shape} {got.dtype} {got.stride()} vs eager {want.shape} {want.dtype} {want.stride()}"
    return None


def _to_float64(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float64(item) for item in value)
    return value


def _as_accurate_as_eager(op, sample, expected, actual) -> bool:
    """bf16 only: eager's native kernels may round once where the decomposed graph rounds per op. Accept a
    result that is no further from a float64 reference than eager's own result is (cancellation cases)."""
    try:
        reference = op.op(_to_float64(sample.input), *_to_float64(sample.args), **sample.kwargs)
    except Exception:  # noqa: BLE001 - no float64 reference: keep the strict verdict
        return False
    pairs = list(zip(_flatten(expected), _flatten(actual), _flatten(reference)))
    if not pairs or len(pairs) != len(_flatten(expected)):
        return False
    for want, got, ref in pairs:
        if not want.is_floating_point() or got.shape != ref.shape:
            return False
        eager_error = (want.double() - ref).abs().nan_to_num(0.0).max().item() if want.numel() else 0.0
        our_error = (got.double() - ref).abs().nan_to_num(0.0).max().item() if got.numel() else 0.0
        if our_error > eager_error or (got.isnan() != want.isnan()).any():
            return False
    return True


def _call(op, sample):
    return op.op(sample.input, *sample.args, **sample.kwargs)


def sweep_op(op, dtype, max_samples: int):
    """Returns (status, nki_nodes, fallback_nodes, reasons Counter, first error) for one op and dtype."""
    try:
        samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))[:max_samples]
    except Exception as error:  # noqa: BLE001 - a broken sample generator is the corpus's problem, not ours
        return "no samples", 0, 0, collections.Counter(), f"sample_inputs: {error}"
    nki_nodes = fallback_nodes = ran = 0
    reasons: collections.Counter = collections.Counter()
    mismatch = None
    for sample in samples:
        try:
            torch.manual_seed(0)
            expected = _call(op, sample)
        except Exception:  # noqa: BLE001 - eager itself rejects this sample: nothing to compare
            continue
        torch._dynamo.reset()
        neuron_compile.reset_stats()

        def fn(*args, _sample=sample):
            return op.op(*args, *_sample.args, **_sample.kwargs)

        try:
            torch.manual_seed(0)
            actual = torch.compile(fn, backend="neuron")(sample.input)
        except Exception as error:  # noqa: BLE001 - any failure is recorded as incorrect, with its message
            mismatch = mismatch or f"compiled run raised {type(error).__name__}: {str(error).splitlines()[0][:160]}"
            ran += 1
            continue
        ran += 1
        stats = neuron_compile.stats()
        nki_nodes += stats["nki_nodes"]
        fallback_nodes += stats["fallback_nodes"]
        reasons.update(stats["fallback_reasons"])
        if op.name in UNINITIALIZED_OUTPUT:
            problem = _same_metadata(expected, actual)
        else:
            problem = _same(expected, actual, dtype)
            if problem and dtype == torch.bfloat16 and _as_accurate_as_eager(op, sample, expected, actual):
                accepted_by_reference.add(op.name)
                problem = None
        if problem:
            mismatch = mismatch or problem
    if ran == 0:
        return "eager rejects all samples", 0, 0, reasons, None
    return ("wrong" if mismatch else "correct"), nki_nodes, fallback_nodes, reasons, mismatch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", help="comma-separated OpInfo names (default: all)")
    parser.add_argument("--samples", type=int, default=3, help="sample inputs per op and dtype")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--verbose", action="store_true", help="print one line per op")
    parser.add_argument("--rows", metavar="FILE", help="also write one JSON line per (op, dtype) with its fallback reasons")
    args = parser.parse_args(argv)
    os.environ.setdefault("NEURON_COMPILE_FALLBACK", "silent")
    warnings.simplefilter("ignore")
    wanted = set(args.ops.split(",")) if args.ops else None
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]

    started = time.time()
    rows: list[dict] = []  # one per (op, dtype): the table, the wrong list and --rows all read these
    all_reasons: collections.Counter = collections.Counter()
    for op in op_db:
        if wanted and op.name not in wanted:
            continue
        for dtype in dtypes:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            status, nki, fallback, reasons, problem = sweep_op(op, dtype, args.samples)
            all_reasons.update(reasons)
            if status in ("no samples", "eager rejects all samples"):
                lowering = "-"
            elif fallback == 0 and nki > 0:
                lowering = "full"
            elif nki > 0:
                lowering = "partial"
            elif fallback == 0:
                lowering = "no nodes"  # no ATen node reached the backend (alias-only, random ops, graph breaks)
            else:
                lowering = "none"
            rows.append(dict(op=op.name, variant=op.variant_test_name, dtype=str(dtype), status=status,
                             lowering=lowering, problem=problem, nki_nodes=nki, fallback_nodes=fallback,
                             reasons=dict(reasons)))
            if args.verbose:
                print(f"{op.name:32s} {str(dtype):15s} {status:8s} {lowering:8s} {problem or ''}", flush=True)

    print(f"\nOpInfo sweep: {len(rows)} (op, dtype) pairs in {time.time() - started:.0f} s, "
          f"up to {args.samples} samples each\n")
    print("| dtype | pairs run | correct | wrong | fully lowered | partly | not lowered | no ATen node |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in dtypes:
        run = [r for r in rows if r["dtype"] == str(dtype) and r["lowering"] != "-"]
        count = collections.Counter(r["status"] for r in run)
        lowering = collections.Counter(r["lowering"] for r in run)
        n = len(run) or 1
        print(f"| {str(dtype).replace('torch.', '')} | {len(run)} | {count['correct']} ({100 * count['correct'] / n:.1f}%) "
              f"| {count['wrong']} | {lowering['full']} ({100 * lowering['full'] / n:.1f}%) "
              f"| {lowering['partial']} | {lowering['none']} | {lowering['no nodes']} |")
    print("\nTop fallback reasons (ATen nodes, all samples):")
    for reason, count in all_reasons.most_common(20):
        print(f"  {count:6d}  {reason}")
    if accepted_by_reference:
        print(f"\nbf16 results off eager but at least as close to float64 as eager ({len(accepted_by_reference)}): "
              + ", ".join(sorted(accepted_by_reference)))
    print(f"Uninitialized-output ops compared by shape, dtype and strides only: {', '.join(UNINITIALIZED_OUTPUT)}")
    if args.rows:
        with open(args.rows, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    wrong = [r for r in rows if r["status"] == "wrong"]
    if wrong:
        print(f"\nWrong results ({len(wrong)}):")
        for row in wrong[:40]:
            print(f"  {row['op']}{'.' + row['variant'] if row['variant'] else ''} {row['dtype']}: {row['problem']}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
