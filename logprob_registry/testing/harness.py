"""What the conformance tests use to reach a backend: calls through the public API with
``backend=NAME``, the float64 reference of the same call, test data, and capability skips; all read
from the op table (:mod:`logprob_registry.opspec`: each op's inputs, options, outputs, reference and
example inputs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import pytest
import torch

from logprob_registry.backend import Backend
from logprob_registry.call import key_for
from logprob_registry.dtypes import result_dtype
from logprob_registry.environment import MAIN_DEVICE_ORDER
from logprob_registry.opspec import OPS, make_input
from logprob_registry.registry import get_registry

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
                features: Sequence[str] = (), vocab: Optional[int] = None) -> None:
        """Skip the test, with the registry's reason, unless the backend can run this case here
        (``features``: the ``opspec.FEATURES`` the case needs; ``vocab``: the vocabulary size of the
        case, so that the key is the public call's, None when the case has several)."""
        key = key_for(op, device=self.device, dtype=dtype, requires_grad=grad, features=features, vocab=vocab)
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
        """Example logits (the op table's :func:`~logprob_registry.opspec.make_input`), times ``scale``."""
        g = torch.Generator().manual_seed(seed)
        return make_input("logits", shape, dtype, g, scale=scale).to(self.device)

    def labels(self, shape: Sequence[int], vocab: int, dtype: torch.dtype = torch.int64, seed: int = 1) -> torch.Tensor:
        """Example labels, uniform over ``vocab`` (the op table's :func:`~logprob_registry.opspec.make_input`)."""
        g = torch.Generator().manual_seed(seed)
        return make_input("labels", shape, dtype, g, vocab=vocab).to(dtype).to(self.device)

    # ------------------------------------------------------------------ calls
    def call(self, op: str, *inputs: Optional[torch.Tensor], temperature: float = 1.0,
             ignore_index: Optional[int] = None, inplace_backward: bool = False, **options) -> Tuple[torch.Tensor, ...]:
        """The public function of ``op`` with ``backend=NAME`` on its positional ``inputs`` (those the
        op takes: ``labels`` are left out for the entropy); always a tuple of outputs. Options the op
        does not take are left out (``ignore_index`` for the entropy)."""
        spec = OPS[op]
        given = dict(temperature=temperature, ignore_index=ignore_index, inplace_backward=inplace_backward, **options)
        kwargs = spec.options_of(given)
        return spec.unpack(spec.public()(*inputs[: len(spec.inputs)], backend=self.name, **kwargs), kwargs)

    @staticmethod
    def reference(op: str, *inputs: Optional[torch.Tensor], **options) -> Tuple[torch.Tensor, ...]:
        """The float64 ground truth of the same call (the op table's), computed on the CPU (autograd
        flows through the inputs that require gradients). Options the op does not take are left out."""
        spec = OPS[op]
        cpu = [None if x is None else x.cpu() for x in inputs[: len(spec.inputs)]]
        kwargs = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in spec.options_of(options).items()}
        return spec.ground_truth(*cpu, **kwargs)

    def call_hidden(self, hidden, weight, labels, **options) -> Tuple[torch.Tensor, ...]:
        return self.call("logprobs_from_hidden", hidden, weight, labels, **options)

    @staticmethod
    def reference_hidden(hidden, weight, labels, **options) -> Tuple[torch.Tensor, ...]:
        return Harness.reference("logprobs_from_hidden", hidden, weight, labels, **options)

    def result_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return result_dtype(dtype)
