"""What the conformance tests use to reach a backend: calls through the public API with
``backend=NAME``, the float64 reference of the same call, test data, and capability skips."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import pytest
import torch

from logprob_registry import reference as ref
from logprob_registry.backend import Backend
from logprob_registry.dtypes import result_dtype
from logprob_registry.environment import MAIN_DEVICE_ORDER
from logprob_registry.opspec import OPS
from logprob_registry.registry import Key, get_registry

#: Ops over logits that give log-probabilities of labels and/or the entropy, and those of them that
#: take labels (read from the op table). ``topk_logprobs`` (which returns ids) has its own tests, and
#: the vocabulary-parallel shard ops (no public function) the distributed section.
LOGITS_OPS = tuple(name for name, spec in OPS.items()
                   if spec.dtype_input == "logits" and spec.function is not None
                   and set(spec.outputs) <= {"logprobs", "entropy"})
LABEL_OPS = tuple(name for name in LOGITS_OPS if "labels" in OPS[name].inputs)
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def default_device(backend: Backend) -> str:
    """The machine's main device if the backend runs there, else the backend's first device type
    in the order the registry ranks devices (tests then skip, naming it, if it is absent)."""
    main = get_registry().environment().main_device
    if main in backend.devices:
        return main
    return next(d for d in MAIN_DEVICE_ORDER if d in backend.devices)


@dataclass
class Harness:
    """One backend on one device, as the suite sees it."""

    backend: Backend
    device: torch.device

    @property
    def name(self) -> str:
        return self.backend.name

    # ------------------------------------------------------------------ skips
    def require(self, op: str, dtype: torch.dtype = torch.float32, grad: bool = False,
                features: Sequence[str] = ()) -> None:
        """Skip the test, with the registry's reason, unless the backend can run this case here
        (``features``: the ``opspec.FEATURES`` the case needs)."""
        key = Key(op, self.device.type, dtype, grad, frozenset(features))
        verdict = next(v for v in get_registry().verdicts(key) if v.name == self.name)
        if verdict.reason is not None:
            pytest.skip(f"{self.name}: {verdict.reason}")

    def require_capability(self, flag: str, why: str) -> None:
        if not getattr(self.backend, flag):
            pytest.skip(f"{self.name} does not declare {flag}=True, so {why} is not promised")

    def first_op(self, ops: Sequence[str]) -> str:
        for op in ops:
            if self.backend.supports(op):
                return op
        pytest.skip(f"{self.name} implements none of {', '.join(ops)}")

    # ------------------------------------------------------------------- data
    def logits(self, shape: Sequence[int], dtype: torch.dtype = torch.float32, scale: float = 3.0,
               seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tuple(shape), generator=g, dtype=result_dtype(dtype))
        return x.mul_(scale).to(dtype).to(self.device)

    def labels(self, shape: Sequence[int], vocab: int, dtype: torch.dtype = torch.int64, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, max(vocab, 1), tuple(shape), generator=g).to(dtype).to(self.device)

    # ------------------------------------------------------------------ calls
    def call(self, op: str, logits: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
             temperature: float = 1.0, ignore_index: Optional[int] = None,
             inplace_backward: bool = False, **options) -> Tuple[torch.Tensor, ...]:
        """The public function of ``op`` with ``backend=NAME``; always a tuple of outputs. Options
        the op does not take are left out (``ignore_index`` for the entropy)."""
        spec = OPS[op]
        given = dict(temperature=temperature, ignore_index=ignore_index, inplace_backward=inplace_backward, **options)
        kwargs = {k: v for k, v in given.items() if k in spec.option_index}
        inputs = (logits, labels)[: len(spec.inputs)]
        out = spec.public()(*inputs, backend=self.name, **kwargs)
        return tuple(out) if len(spec.output_names(kwargs)) > 1 else (out,)

    @staticmethod
    def reference(op: str, logits: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                  temperature: float = 1.0, ignore_index: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
        """The float64 ground truth of the same call, computed on the CPU (autograd flows through
        ``logits`` when it requires gradients)."""
        x = logits.cpu()
        y = None if labels is None else labels.cpu()
        if op == "entropy":
            return (ref.entropy(x, temperature=temperature),)
        if op == "logprobs":
            return (ref.logprobs(x, y, temperature=temperature, ignore_index=ignore_index),)
        return tuple(ref.logprobs_and_entropy(x, y, temperature=temperature, ignore_index=ignore_index))

    def call_hidden(self, hidden, weight, labels, *, bias=None, temperature=1.0, ignore_index=None,
                    return_entropy=False, **options) -> Tuple[torch.Tensor, ...]:
        spec = OPS["logprobs_from_hidden"]
        kwargs = dict(bias=bias, temperature=temperature, ignore_index=ignore_index,
                      return_entropy=return_entropy, **options)
        out = spec.public()(hidden, weight, labels, backend=self.name, **kwargs)
        return tuple(out) if len(spec.output_names(kwargs)) > 1 else (out,)

    @staticmethod
    def reference_hidden(hidden, weight, labels, *, bias=None, temperature=1.0, ignore_index=None,
                         return_entropy=False) -> Tuple[torch.Tensor, ...]:
        out = ref.logprobs_from_hidden(
            hidden.cpu(), weight.cpu(), labels.cpu(), bias=None if bias is None else bias.cpu(),
            temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy)
        return tuple(out) if return_entropy else (out,)

    def result_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return result_dtype(dtype)
