"""Calls that a CUDA graph can capture: while one is captured (``kit.capturing``) nothing reads
device values on the host, since that fails the capture (the label range check's ``int(...)``
did, through the public functions). Reproduced on the CPU: ``capturing`` is made to answer True
and a dispatch mode fails every op that reads a value on the host; the results and gradients are
the bits of the ordinary call, which does read them (the chunked backend's rare-label rows and
skipped chunks, the fused op's active rows). The capture itself, and its replay, run on a GPU
(``scripts/gpu_proof.py``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import logprob_registry as lr
from logprob_registry import kit, validation
from logprob_registry.kernels import chunked

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten._unique2.default,
              aten.masked_select.default}


class NoHostReads(TorchDispatchMode):
    """Fails an op that reads device values on the host (what a CUDA graph capture refuses)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        boolean_index = func is aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1])
        if func in HOST_READS or boolean_index:
            raise AssertionError(f"{func} reads device values on the host: a CUDA graph capture fails there")
        return func(*args, **kwargs)


@pytest.fixture
def small_chunks():
    saved = chunked.workspace_bytes()
    chunked.set_workspace_bytes(1)  # two rows per chunk: the backward's chunks of ignored rows exist
    yield
    chunked.set_workspace_bytes(saved)


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 64, generator=g, dtype=torch.float64).float() * 3
    labels = torch.randint(0, 64, (2, 6), generator=g)
    labels[0, :4] = -100  # two chunks of ignored rows
    labels[1, 2] = 5
    logits[1, 2, 5] = -300.0  # a label too improbable for its probability alone (chunked's rare rows)
    hidden = torch.randn(2, 6, 16, generator=g)
    weight = torch.randn(64, 16, generator=g) * 0.3
    return logits, labels, hidden, weight


def _step(backend):
    """Every logits op and the fused op, forward and backward, through the public functions."""
    logits, labels, hidden, weight = _inputs()
    x = logits.clone().requires_grad_(True)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp = lr.logprobs_from_logits(x, labels, ignore_index=-100, backend=backend)
    lp2, ent = lr.logprobs_and_entropy(x, labels, ignore_index=-100, backend=backend)
    ent2 = lr.entropy_from_logits(x, backend=backend)
    fused = lr.logprobs_from_hidden(h, w, labels, ignore_index=-100, backend=backend)
    outs = (lp, lp2, ent, ent2, fused)
    grads = torch.autograd.grad(sum(o.sum() for o in outs), (x, h, w))
    return [o.detach() for o in outs] + list(grads)


# compiled's kernels cannot run under a dispatch mode (torch.compile refuses one); its Python around
# them shares kit.on_active_rows and the validated call, and the GPU script captures it
@pytest.mark.parametrize("backend", ["naive", "chunked"])
def test_no_host_reads_while_a_cuda_graph_is_captured(backend, small_chunks, monkeypatch):
    ordinary = _step(backend)
    with pytest.raises(AssertionError, match="reads device values on the host"), NoHostReads():
        _step(backend)  # the mode catches what the ordinary call reads
    for module in (kit, validation):
        monkeypatch.setattr(module, "capturing", lambda t: True)
    with NoHostReads():
        captured = _step(backend)
    for a, b in zip(captured, ordinary):
        assert torch.equal(a, b)


def test_capturing_is_false_off_cuda():
    assert not kit.capturing(torch.zeros(1)) and validation.values_visible(torch.zeros(1))
