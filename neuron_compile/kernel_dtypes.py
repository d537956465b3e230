"""The dtypes a kernel buffer holds: torch's dtype for each kernel dtype name, and the kernel dtype name of each
torch dtype a region may take in or hand back.

Lowering names buffer dtypes with these (lowering/registry.py); the runtime checks tensors against them and allocates
outputs with them (runtime/region.py, runtime/launcher.py). Kept in a module of its own so a warm start, which runs
stored kernels, needs none of the lowering stage.
"""

from __future__ import annotations

import torch

# Integer tensors get an int32 kernel dtype (NKI has no int64: int64 inputs are narrowed at the region boundary,
# only when every value fits).
SUPPORTED_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.bool: "bool",
                    torch.int32: "int32", torch.int64: "int32"}
# Torch dtype of each kernel buffer dtype (ir.Buffer.dtype); NKI has no int64 and stores bool as a byte.
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bool": torch.bool, "int32": torch.int32}
