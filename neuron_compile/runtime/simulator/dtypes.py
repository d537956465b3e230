"""Simulator stage: ``nki.dtype`` — the NKI data types as numpy dtypes (ml_dtypes for bf16, fp8, fp4, e8m0).

Input: nothing. Output: one numpy dtype per NKI dtype name, which ``nki.language`` re-exports (``nl.bfloat16``
is ``nki.dtype.bfloat16``) and published kernels use in type hints (``dtype: nki.dtype``).

The packed "x4" types (four fp8 or fp4 values in one 32-bit element, the operands of the MX matmul on
NeuronCore-v4) have no numpy equivalent: each is a distinct 4-byte structured dtype, so a kernel can allocate,
move and ``.view()`` them, and any arithmetic on them is refused by the instruction that meets them.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
tfloat32 = np.dtype(np.float32)  # simulated as fp32 (tf32 rounding happens inside TensorE)
int8, int16, int32 = np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32)
uint8, uint16, uint32 = np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)
bool_ = np.dtype(np.uint8)  # NKI's bool_ is a byte


def _packed_x4(name: str) -> np.dtype:
    """Four narrow floats packed in one 32-bit element; the field name carries the NKI name."""
    return np.dtype([(name, np.uint32)])


float8_e4m3fn_x4 = _packed_x4("float8_e4m3fn_x4")
float8_e5m2_x4 = _packed_x4("float8_e5m2_x4")
float4_e2m1fn_x4 = _packed_x4("float4_e2m1fn_x4")
PACKED_X4 = (float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4)


def dtype_name(dtype: np.dtype) -> str:
    """The NKI name of a dtype (the packed x4 types included)."""
    if dtype.names:
        return dtype.names[0]
    return dtype.name


__all__ = ["bfloat16", "float8_e4m3", "float8_e5m2", "float8_e4m3fn", "float8_e8m0fnu", "float16", "float32",
           "tfloat32", "int8", "int16", "int32", "uint8", "uint16", "uint32", "bool_", "float8_e4m3fn_x4",
           "float8_e5m2_x4", "float4_e2m1fn_x4"]
