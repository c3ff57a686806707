"""The measured work, as a child process sees it: the inputs, one call of a method (a backend or the
textbook baseline), and the largest difference from a float64 reference.

Everything here is driven by the op table: the inputs are the op's example inputs
(:meth:`~logprob_registry.opspec.OpSpec.example`), a backend is called through the op's public
function, the reference is the op's ground truth (:meth:`~logprob_registry.opspec.OpSpec.ground_truth`),
and the baseline reduces the op's logits (given, or ``hidden @ weight.T``) to each of its outputs
(``kl_divergence``: the log-softmax of both sides' logits, then the sum). Where ``liger_kernel``
imports and the device is CUDA, ``kl_divergence`` also gets a row for Liger-Kernel's KL loss
(:data:`EXTERNAL`). Peers' kernels are measured as the backends of their plugins (plugins/trl,
plugins/torch-lce), outside the dtypes they declare with ``--undeclared``.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from .settings import REFERENCE_CHUNK_ELEMENTS, Setting

BASELINE = "baseline"
LIGER = "liger-kl"
#: The mark of a backend measured outside the dtypes it declares (``bench --undeclared``): its name
#: followed by it is the method's name.
UNDECLARED = "!"


def baseline_description(s: Setting, short: bool = False) -> str:
    """What the baseline does for setting ``s`` (``short``: for a table's heading)."""
    if "kl" in s.outputs:
        form = "each side's hidden @ weight.T, then " if s.forms_logits else ""
        if short:
            return f"{form}the textbook formula in the input dtype"
        return (f"the textbook formula in the input dtype: {form}log_softmax of the student's and the teacher's "
                "logits, then sum(p * (log p - log q)) over the vocabulary")
    form = "hidden @ weight.T, then " if s.forms_logits else ""
    if short:
        return f"{form}the textbook formula in the input dtype"
    return (f"the textbook formula in the input dtype: {form}log_softmax + gather, and -sum(p * log p) "
            "for the entropy (the seeds' starting point)")


def op_logits(inputs: Mapping[str, torch.Tensor], side: str = "logits") -> torch.Tensor:
    """The logits an op reduces: its ``logits`` input, or ``hidden @ weight.T`` formed in the
    inputs' dtype (what a trainer does without the fused op). ``side``: ``kl_divergence``'s
    ``student`` or ``teacher``, given as logits, or as hidden states with its ``*_weight``."""
    if side != "logits":
        weight = inputs.get(f"{side}_weight")
        return inputs[side] if weight is None else inputs[side] @ weight.T
    if "logits" in inputs:
        return inputs["logits"]
    if "inputs" in inputs:  # token_stats: logits, or hidden states with the option weight
        return inputs["inputs"] if inputs.get("weight") is None else inputs["inputs"] @ inputs["weight"].T
    return inputs["hidden"] @ inputs["weight"].T


def kl_log_softmaxes(inputs: Mapping[str, torch.Tensor], options: Mapping[str, Any]) -> Tuple[torch.Tensor, ...]:
    """``(log p, log q)`` of KL(p || q) as ``kl_divergence`` defines it (``direction`` forward:
    p the teacher's, q the student's; reverse: swapped), each the log-softmax of a side's tempered
    logits in the inputs' dtype; the teacher detached."""
    temperature = options.get("temperature", 1.0)
    student, teacher = op_logits(inputs, "student"), op_logits(inputs, "teacher").detach()
    if temperature != 1.0:
        student, teacher = student / temperature, teacher / temperature
    log_q, log_p = student.log_softmax(-1), teacher.log_softmax(-1)
    return (log_p, log_q) if options.get("direction", "forward") == "forward" else (log_q, log_p)


def textbook_kl(inputs: Mapping[str, torch.Tensor], options: Mapping[str, Any]) -> torch.Tensor:
    """The textbook KL per position: ``sum(p * (log p - log q))`` over the vocabulary."""
    log_p, log_q = kl_log_softmaxes(inputs, options)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def liger_kl(inputs: Mapping[str, torch.Tensor], options: Mapping[str, Any]) -> torch.Tensor:
    """Liger-Kernel's KL loss (``LigerKLDIVLoss(reduction="none", log_target=True)``, a Triton kernel)
    on the two log-softmaxes, summed over the vocabulary: what a trainer using Liger writes."""
    from liger_kernel.transformers import LigerKLDIVLoss

    log_p, log_q = kl_log_softmaxes(inputs, options)
    v = log_q.shape[-1]
    loss = LigerKLDIVLoss(reduction="none", log_target=True)(log_q.reshape(-1, v), log_p.reshape(-1, v))
    return loss.sum(-1).reshape(log_q.shape[:-1])


def liger_available() -> bool:
    """Whether ``liger_kernel`` can be imported here (checked without importing it)."""
    try:
        return importlib.util.find_spec("liger_kernel") is not None
    except (ImportError, ValueError):
        return False


#: Methods that are neither a backend nor the baseline: name -> (description, whether it runs a
#: setting, the call). Liger-Kernel's KL loss, for ``kl_divergence`` on CUDA where it imports.
EXTERNAL: Dict[str, Tuple[str, Callable[[Setting], bool], Callable[..., torch.Tensor]]] = {
    LIGER: ("Liger-Kernel's LigerKLDIVLoss(reduction='none', log_target=True) on the log_softmax of both "
            "sides (Triton; rows appear only where liger_kernel imports and the device is CUDA)",
            lambda s: "kl" in s.outputs and s.device_type == "cuda" and liger_available(), liger_kl),
}


def external_methods(s: Setting) -> List[Tuple[str, str]]:
    """The external methods (:data:`EXTERNAL`) measured for ``s``: ``(name, description)``."""
    return [(name, doc) for name, (doc, runs, _) in EXTERNAL.items() if runs(s)]


#: Each output an op may return, from the log-softmax of its logits: the textbook formulas (the
#: token_stats fields of a call without truncation: raw = processed; the logits' mean, max and
#: argmax are those of the log-softmax shifted by a constant).
TEXTBOOK: Dict[str, Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]] = {
    "logprobs": lambda logp, labels: logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1),
    "entropy": lambda logp, labels: -(logp.exp() * logp).sum(-1),
    "raw_logprobs": lambda logp, labels: logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1),
    "raw_entropy": lambda logp, labels: -(logp.exp() * logp).sum(-1),
    "log_sum_p2": lambda logp, labels: torch.logsumexp(2 * logp, -1),
    "is_argmax": lambda logp, labels: logp.argmax(-1) == labels,
}
#: The outputs whose sum is the loss in backward mode: the differentiable ones (DESIGN: token_stats'
#: log_sum_p2, mean_logit, max_logit and is_argmax are not).
LOSS_OUTPUTS = frozenset({"logprobs", "entropy", "raw_logprobs", "raw_entropy", "kl"})


def loss(s: Setting, outs: Tuple[torch.Tensor, ...], in_float32: bool = True) -> torch.Tensor:
    """The sum of the outputs in :data:`LOSS_OUTPUTS` (each summed in float32, or in its own dtype)."""
    return sum((o.float() if in_float32 else o).sum() for name, o in zip(s.outputs, outs) if name in LOSS_OUTPUTS)


#: The textbook token_stats fields computed from the logits themselves.
TEXTBOOK_LOGITS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mean_logit": lambda z: z.mean(-1),
    "max_logit": lambda z: z.amax(-1),
}


def baseline(inputs: Mapping[str, torch.Tensor], outputs: Tuple[str, ...],
             options: Optional[Mapping[str, Any]] = None) -> Tuple[torch.Tensor, ...]:
    if outputs == ("kl",):
        return (textbook_kl(inputs, options or {}),)
    z = op_logits(inputs)
    logp = z.log_softmax(-1)
    return tuple(TEXTBOOK_LOGITS[o](z) if o in TEXTBOOK_LOGITS else TEXTBOOK[o](logp, inputs.get("labels"))
                 for o in outputs)


def _call_args(s: Setting, inputs: Mapping[str, torch.Tensor]) -> Tuple[Tuple[torch.Tensor, ...], Dict[str, Any]]:
    """The op's positional inputs and keyword options (the weight options among them) for ``inputs``."""
    return tuple(inputs[n] for n in s.spec.inputs), dict(s.options, **{n: inputs[n] for n in s.hidden_weights})


def reference(s: Setting, inputs: Mapping[str, torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """The outputs of ``s``'s call in float64: the op table's ground truth (inputs already float64)."""
    args, options = _call_args(s, inputs)
    return s.spec.ground_truth(*args, **options)


def method(s: Setting, name: str) -> Callable[[Mapping[str, torch.Tensor]], Tuple[torch.Tensor, ...]]:
    """``f(inputs)`` running ``s.op`` through backend ``name`` (its public function, with
    ``backend=name``), the baseline, or an external method (:data:`EXTERNAL`); the outputs as a tuple."""
    spec, outputs, options = s.spec, s.outputs, s.options
    if name == BASELINE:
        return lambda inputs: baseline(inputs, outputs, options)
    if name in EXTERNAL:
        external = EXTERNAL[name][2]
        return lambda inputs: (external(inputs, options),)
    if name.endswith(UNDECLARED):
        return undeclared(s, name[: -len(UNDECLARED)])
    public = spec.public()

    def call(inputs: Mapping[str, torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        args, kwargs = _call_args(s, inputs)
        return spec.unpack(public(*args, backend=name, **kwargs), kwargs)  # token_stats: the fields asked

    return call


def undeclared(s: Setting, name: str) -> Callable[[Mapping[str, torch.Tensor]], Tuple[torch.Tensor, ...]]:
    """``f(inputs)`` running backend ``name``'s kernel for ``s.op`` on the validated call
    (:func:`~logprob_registry.call.validate`, every check a call makes) with the options it
    receives, without asking the registry whether it accepts the dtype: what a backend declaring
    only float32 (a peer) does with bf16 inputs, for ``bench --undeclared``."""
    from ..call import validate
    from ..registry import get_registry

    spec = s.spec
    backend = get_registry().get(name)
    kernel = backend.ops[s.op]

    def call(inputs: Mapping[str, torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        args, kwargs = _call_args(s, inputs)
        c = validate(s.op, dict(zip(spec.inputs, args), **kwargs))
        return spec.unpack(kernel(*c.inputs, **spec.backend_options(backend.features, c.options)), kwargs)

    return call


class Workload:
    """The inputs of one setting and how to run a method on them once.

    The inputs are the op's example inputs for the setting's shape, dtype, device and seed (made on
    the CPU from one seeded generator, so every device sees the same numbers, then moved). In
    backward mode each call gets fresh gradients (and, for in-place backward, fresh copies of the
    inputs made before the clock starts); the loss is the sum of every output.
    """

    def __init__(self, s: Setting, name: str) -> None:
        self.s = s
        self.fn = method(s, name)
        example = s.spec.example(s.shape, s.torch_dtype, s.device, seed=s.seed, hidden_size=s.hidden_size)
        # the inputs, then the weight options (kl_divergence's hidden states)
        self.base: Dict[str, torch.Tensor] = dict(example.inputs, **{n: example.options[n] for n in s.hidden_weights})
        self.leaves: Dict[str, torch.Tensor] = {}
        if not s.inplace_backward:
            for n in s.grad_inputs:
                self.base[n].requires_grad_(True)

    def view(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """What the methods see of input ``name``: with ``--slice``, ``[:, :-1]`` (labels ``[:, 1:]``)."""
        if not (self.s.sliced and self.s.per_token(name)):
            return t
        return t[:, 1:] if name == "labels" else t[:, :-1]

    @property
    def inputs(self) -> Dict[str, torch.Tensor]:
        """The inputs the methods see (no autograd history)."""
        return {n: self.view(n, t.detach()) for n, t in self.base.items()}

    def prepare(self) -> Dict[str, torch.Tensor]:
        """The inputs of the next call; everything not part of the method's work happens here."""
        if not self.s.backward:
            return self.inputs
        leaves = {}
        for n in self.s.grad_inputs:
            if self.s.inplace_backward:
                leaves[n] = self.base[n].detach().clone().requires_grad_(True)
            else:
                self.base[n].grad = None
                leaves[n] = self.base[n]
        self.leaves = leaves
        return {n: self.view(n, leaves.get(n, t.detach())) for n, t in self.base.items()}

    def run(self, x: Mapping[str, torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        if not self.s.backward:
            with torch.no_grad():
                return self.fn(x)
        outs = self.fn(x)
        loss(self.s, outs).backward()
        return tuple(o.detach() for o in outs)

    def grads(self) -> Dict[str, torch.Tensor]:
        """The gradients of the last backward call, as the methods' views see them."""
        return {n: self.view(n, leaf.grad) for n, leaf in self.leaves.items() if leaf.grad is not None}

    def release(self) -> None:
        for leaf in self.leaves.values():
            leaf.grad = None
        self.leaves = {}


def _worse(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _max_abs(got: torch.Tensor, want: torch.Tensor, device: torch.device) -> float:
    if not want.is_floating_point():  # token_stats' is_argmax: 1 where it differs
        want = want.to(torch.float64)
    return (got.to(device, torch.float64) - want).abs().max().item() if want.numel() else 0.0


def max_differences(
    s: Setting, inputs: Mapping[str, torch.Tensor], outs: Tuple[torch.Tensor, ...],
    grads: Optional[Mapping[str, torch.Tensor]] = None,
) -> Tuple[float, Dict[str, float]]:
    """Largest absolute difference of the outputs (and of the gradients of their sum, for each
    input in ``grads``) from float64 autograd of the reference.

    Computed over chunks of rows of the per-token inputs, so that the float64 logits of a chunk
    hold at most :data:`REFERENCE_CHUNK_ELEMENTS` elements; an input shared by every row (the
    weight) is converted once, and its gradient accumulated over the chunks.
    """
    grads = dict(grads or {})
    any_input = next(iter(inputs.values()))
    ref_device = any_input.device if any_input.device.type != "mps" else torch.device("cpu")  # MPS: no float64
    per_token = [n for n in inputs if s.per_token(n)]
    shared = {n: inputs[n].to(ref_device, torch.float64 if not s.kind(n).integer else inputs[n].dtype)
              .requires_grad_(n in grads) for n in inputs if n not in per_token}
    b, t = inputs[per_token[0]].shape[:2]
    rows = max(1, REFERENCE_CHUNK_ELEMENTS // s.shape[2])
    value_diff = 0.0
    grad_diff = {n: 0.0 for n in grads}
    for i in range(b):
        for t0 in range(0, t, rows):
            idx = (i, slice(t0, t0 + rows))
            chunk = dict(shared)
            for n in per_token:
                x = inputs[n][idx].to(ref_device)
                if not s.kind(n).integer:
                    x = x.to(torch.float64).requires_grad_(n in grads)
                chunk[n] = x
            expected = reference(s, chunk)
            for got, want in zip(outs, expected):
                value_diff = _worse(value_diff, _max_abs(got[idx], want.detach(), ref_device))
            if grads:
                loss(s, expected, in_float32=False).backward()
                for n in per_token:
                    if n in grads:
                        grad_diff[n] = _worse(grad_diff[n], _max_abs(grads[n][idx], chunk[n].grad, ref_device))
    for n, x in shared.items():
        if n in grads:
            grad_diff[n] = _worse(grad_diff[n], _max_abs(grads[n], x.grad, ref_device))
    return value_diff, grad_diff

