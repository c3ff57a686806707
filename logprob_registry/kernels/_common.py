"""Helpers the built-in backends share (any plugin may use them too)."""

from __future__ import annotations

import torch

#: Fewer token rows than this are padded with zero rows before a matmul: the CPU matmul takes
#: another path for a handful of rows, which would make a row's result depend on its batch.
MIN_GEMM_ROWS = 16


def pad_rows(x: torch.Tensor, rows: int = MIN_GEMM_ROWS) -> torch.Tensor:
    """``x`` (2-D) with zero rows appended up to ``rows`` rows (``x`` itself if it has them)."""
    short = rows - x.shape[0]
    if short <= 0:
        return x
    return torch.cat([x, x.new_zeros(short, x.shape[1])])
