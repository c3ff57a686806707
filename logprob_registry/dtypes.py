"""The dtype rules every op shares: which float dtypes are accepted, what a result is computed and
returned in, and how dtypes are named in messages."""

from __future__ import annotations

import torch

#: Every floating dtype an op accepts as logits (or hidden states).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Spellings accepted on command lines, to the dtype.
DTYPE_NAMES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


def result_dtype(dtype: torch.dtype) -> torch.dtype:
    """What an op accumulates in and returns for inputs of ``dtype``: float64 stays float64,
    every other float dtype gives float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str) -> torch.dtype:
    """A float dtype from its name (``"bf16"``, ``"float32"``, ``"torch.float16"``), or a
    ValueError listing the names accepted."""
    dtype = DTYPE_NAMES.get(str(name).replace("torch.", "").strip().lower())
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPE_NAMES)}")
    return dtype
