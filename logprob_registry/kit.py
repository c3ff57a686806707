"""The stable helpers a backend author may use: ``from logprob_registry import kit``.

The built-in backends import them from here exactly as a third-party plugin would, so a plugin
that uses them gets the same rules as the built-ins (docs/plugins.md has one line and an example
for each). Everything listed in ``__all__`` is public and kept stable; the modules they come from
are not (kit defines nothing itself). Importing this module is cheap: it needs torch only (never
Triton, never a compiler).

- the Backend record's companions: :class:`Priority` (the named priority bands),
  :class:`Degradation` (what a ``degradations=`` report returns), :class:`Preparation`,
  :class:`Prepared` and :class:`PrepareError` (a ``prepare=`` callable's request, records, failure);
- the result dtype rule: :func:`result_dtype`, :data:`FLOAT_DTYPES`, :func:`dtype_name`;
- autograd: :func:`first_order_only` (a backward that refuses ``create_graph=True``),
  :func:`second_order_gradient` (a backward that supports it), :func:`backward_without_autocast`,
  :func:`autocast_enabled`, :func:`autocast_off`;
- inputs: :func:`overlapping` (logits whose gradient cannot be written in place), :class:`Sampler`
  (``kit.Sampler.of(keywords).used`` / ``.truncates`` for the sampler keywords a backend received);
- the op table's ground truth: :func:`reference_outputs` (a logits op's outputs in its result
  dtype, for degenerate inputs: nothing to chunk or compile for), :func:`reference_function` (an
  op's ground-truth function, computing in the dtype it is asked for: ``naive`` runs it in float32);
- the sampler's truncation decision as the engines make it: :func:`truncation_boundary`,
  :func:`kept_from_boundary`, :func:`keep_mask`, :func:`topk_ids`, :func:`float32_value`;
- batch-invariant matmuls: :data:`MIN_GEMM_ROWS`, :func:`pad_rows`, :func:`add_matmul`;
- ignored rows: :func:`on_active_rows` (a per-row op run on the rows whose label is not ignored);
- a frozen lm_head: :func:`label_minus_mean` (the hidden gradient from an accumulated ``softmax @ W``);
- ``token_stats``' fields: :data:`LABEL_STATS`, :data:`DIFFERENTIABLE_STATS`, :func:`stats_asked`, :func:`asked_stats`,
  :func:`stats_gradients` (a field's and its raw twin's upstream gradients added), :func:`fixed_stats`;
  ``is_argmax`` without an argmax reduction: :func:`first_max` (from the running max before the label);
- CUDA graphs: :func:`capturing` (no host reads of device values while a graph is captured);
- the tile protocol of the shard ops (``shard_stats``, ``shard_grad``, ...): :data:`TILE`,
  :func:`grid` (:class:`Slot`), :func:`grid_offset`, :func:`exact_sum` (:data:`QUANTUM_BITS`,
  :func:`exact_parts`: the same bits from float32 adds), :func:`n_tiles`,
  :func:`tiled`, :func:`tile_stats_` (:func:`token_tile_stats_`), :func:`tree_sum`,
  :func:`label_columns`, :func:`next_power_of_two`; the sampler's processing of a shard's block:
  :func:`shard_processed`, :func:`shard_rounded`, :func:`shard_kept`, :func:`shard_masked`,
  :func:`shard_label_values`, :func:`shard_grad_z`, :func:`shard_chain`, :func:`shard_top_list`,
  :func:`merge_top_lists`, :data:`PAD_ID`;
- a backend's own environment variables: :class:`Variable`, :func:`declare_variable`,
  :func:`variable_value`, :func:`parse_bytes`, :func:`positive_bytes`.
"""

from __future__ import annotations

from .amp import backward_without_autocast
from .amp import enabled as autocast_enabled
from .amp import off as autocast_off
from .autograd import first_order_only, overlapping, second_order_gradient
from .backend import Degradation, Preparation, Prepared, PrepareError, Priority
from .config import Variable, parse_bytes, positive_bytes
from .config import declare as declare_variable
from .config import get as variable_value
from .distributed.tiles import (
    CROSS_BITS,
    NEG_INF,
    QUANTUM_BITS,
    TILE,
    Slot,
    exact_parts,
    exact_sum,
    grid,
    grid_offset,
    label_columns,
    n_tiles,
    next_power_of_two,
    tile_stats_,
    tiled,
    token_tile_stats_,
    tree_sum,
)
from .dtypes import FLOAT_DTYPES, dtype_name, result_dtype
from .opspec import DIFFERENTIABLE_STATS, LABEL_STATS, asked_stats, fixed_stats, stats_asked, stats_gradients
from .processing import PAD_ID
from .processing import chain as shard_chain
from .processing import grad_z as shard_grad_z
from .processing import kept as shard_kept
from .processing import label_values as shard_label_values
from .processing import masked as shard_masked
from .processing import merge_lists as merge_top_lists
from .processing import processed as shard_processed
from .processing import rounded as shard_rounded
from .processing import top_list as shard_top_list
from .rows import MIN_GEMM_ROWS, add_matmul, first_max, label_minus_mean, on_active_rows, pad_rows
from .sampler import Sampler
from .truncation import float32_value, keep_mask, kept_from_boundary, topk_ids, truncation_boundary
from .truth import reference_function, reference_outputs
from .validation import capturing

__all__ = [
    "DIFFERENTIABLE_STATS",
    "FLOAT_DTYPES",
    "LABEL_STATS",
    "MIN_GEMM_ROWS",
    "NEG_INF",
    "PAD_ID",
    "TILE",
    "Degradation",
    "Preparation",
    "PrepareError",
    "Prepared",
    "Priority",
    "Sampler",
    "Variable",
    "add_matmul",
    "asked_stats",
    "autocast_enabled",
    "autocast_off",
    "backward_without_autocast",
    "capturing",
    "declare_variable",
    "dtype_name",
    "first_max",
    "fixed_stats",
    "first_order_only",
    "float32_value",
    "keep_mask",
    "kept_from_boundary",
    "label_columns",
    "label_minus_mean",
    "merge_top_lists",
    "n_tiles",
    "next_power_of_two",
    "on_active_rows",
    "overlapping",
    "pad_rows",
    "parse_bytes",
    "positive_bytes",
    "reference_function",
    "reference_outputs",
    "result_dtype",
    "second_order_gradient",
    "shard_chain",
    "shard_grad_z",
    "shard_kept",
    "shard_label_values",
    "shard_masked",
    "shard_processed",
    "shard_rounded",
    "shard_top_list",
    "stats_asked",
    "stats_gradients",
    "tile_stats_",
    "token_tile_stats_",
    "tiled",
    "Slot",
    "CROSS_BITS",
    "exact_parts",
    "exact_sum",
    "QUANTUM_BITS",
    "grid",
    "grid_offset",
    "topk_ids",
    "tree_sum",
    "truncation_boundary",
    "variable_value",
]
