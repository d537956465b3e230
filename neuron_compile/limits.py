"""Numeric and on-chip limits that several stages share: one definition each.

Input: nothing (definitions). Lowering decides what it may claim with them, tiling plans under them, codegen
emits kernels that rely on them.
"""

# Integers the fp32 engines (VectorE, ScalarE) hold exactly: every integer of magnitude up to 2**24.
FP32_EXACT_INTEGER = 2**24

# The share of a partition's usable SBUF bytes that one kernel's tiles may take (headroom for the allocator).
SBUF_SHARE = 0.75

# Where a gather or scatter sends an out-of-range index: a row far beyond any buffer, so the indirect DMA's
# bounds check fails (the call then runs eagerly and raises eager's error) instead of touching another element.
OUT_OF_RANGE_ROW = 2**30
