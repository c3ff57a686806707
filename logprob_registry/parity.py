"""Parity check against generation: do the registry's log-probabilities of sampled tokens equal the
ones the sampler used?

RL trainers divide the probability of each sampled token under the training forward pass by the
probability the inference engine reported when it sampled it (the importance ratio). The engine
samples from a processed distribution (the model's softcap, temperature, then top_k and top_p,
renormalised over the kept tokens: vLLM's ``processed_logprobs``); a trainer that normalises over
the full vocabulary biases every ratio by the kept mass.

This module takes a Hugging Face causal LM, samples with ``generate`` (temperature, top_k, top_p, min_p;
the model applies its own softcap), takes the processed log-probabilities of the sampled tokens
from the scores ``generate`` returns, then recomputes them from a teacher-forced forward pass
through :func:`logprob_registry.logprobs_from_hidden` (the model's last hidden states and lm_head
weight; the softcap replayed as a keyword), twice: with the truncation replayed (``top_k``,
``top_p``) and without (temperature and softcap only, full vocabulary). It reports what trainers
log: mean and max ``|Δ|`` (``Δ = trainer - generation``), ``mean(exp|Δ|)`` (NeMo-RL's
``token_mult_prob_error``), the k3 KL estimate, the Pearson correlation and the fraction of tokens
whose ratio ``exp(Δ)`` leaves [0.9, 1.1]; and, without the replay, the mean ratio next to the mean
kept mass, which predicts it.

The replay uses ``sampler="hf"``: transformers' order and thresholds (top_k, then top_p against
the float64 ``1 - top_p``, then ``min_p`` on what is left; vLLM applies ``min_p`` first, to the
full distribution). Each report also shows, on a constructed case with ``min_p``
(:func:`order_check`), at how many positions vLLM's order would keep other tokens than
``generate``'s warpers, which ``"hf"`` matches exactly. See docs/parity.md.

``transformers`` is imported only here, inside the functions (``pip install -e ".[parity]"``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .dtypes import dtype_name

#: The models ``--tiny`` builds (randomly initialised from a config, nothing downloaded).
TINY_MODELS = ("llama", "gemma2")
#: Standard deviation of the tiny models' logits: a trained model's spread, so that top_k and
#: top_p remove a realistic share of the mass (a fresh random init gives nearly uniform logits).
TINY_LOGIT_STD = 2.0
#: Ratios outside this interval are counted (the band RL trainers clip or alert on).
RATIO_BAND = (0.9, 1.1)
_U32 = 2.0 ** -24  # float32's unit roundoff


class ParityError(Exception):
    """The parity check cannot run as asked: the message says why and what to do."""


@dataclass(frozen=True)
class Settings:
    """How to sample. ``top_k=None``, ``top_p=None`` and ``min_p=None`` turn that truncation off."""

    temperature: float = 0.7
    top_k: Optional[int] = 50
    top_p: Optional[float] = 0.8
    min_p: Optional[float] = None
    new_tokens: int = 16
    prompts: int = 4
    prompt_length: int = 8
    seed: int = 0

    def check(self) -> "Settings":
        """Self, or a :class:`ParityError` naming the bad value."""
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ParityError(f"temperature must be finite and > 0 (sampling), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ParityError(f"top_k must be >= 1, or None to turn it off, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ParityError(f"top_p must be in (0, 1], or None to turn it off, got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ParityError(f"min_p must be in [0, 1], or None to turn it off, got {self.min_p}")
        for name in ("new_tokens", "prompts", "prompt_length"):
            if getattr(self, name) < 1:
                raise ParityError(f"{name} must be at least 1, got {getattr(self, name)}")
        return self


@dataclass(frozen=True)
class Metrics:
    """What trainers log about ``Δ = logprob(trainer) - logprob(generation)`` per sampled token.
    Tokens the trainer gives ``-inf`` (outside its kept set) are counted in ``outside_kept`` and
    left out of the other numbers."""

    tokens: int
    mean_abs: float
    max_abs: float
    mult_prob_error: float  # mean(exp|Δ|), NeMo-RL's token_mult_prob_error; 1 is perfect
    k3_kl: float  # mean(exp(Δ) - 1 - Δ): KL(generation || trainer) from the generation's samples
    pearson: float
    outside_band: float  # fraction of tokens whose ratio exp(Δ) is outside RATIO_BAND
    mean_ratio: float
    outside_kept: int


@dataclass
class TokenData:
    """The per-token tensors behind a report (float64, one entry per sampled token; not in JSON)."""

    sequences: List[torch.Tensor]  # per prompt: prompt + sampled ids, int64 (P + n,)
    prompt_length: int
    generation: torch.Tensor  # processed logprobs from generate's scores
    replay: torch.Tensor  # registry, truncation replayed
    full: torch.Tensor  # registry, temperature and softcap only
    kept_mass: torch.Tensor  # mass of the kept tokens under softmax(logits / T)
    kept_count: torch.Tensor  # tokens kept by the sampler, per sampled position


@dataclass
class ModelReport:
    """The parity check of one model."""

    model: str
    dtype: str
    softcap: Optional[float]
    vocab_size: int
    settings: Settings
    backend: str
    source: str  # "hidden" (logprobs_from_hidden) or "logits" (the model post-processes its logits)
    replay: Metrics
    full: Metrics
    predicted_mean_ratio: float  # without replay: mean kept mass
    observed_mean_ratio: float  # without replay: mean exp(Δ)
    max_mass_error: float  # max |Δ(without replay) - log(kept mass)|
    mean_kept_tokens: float
    logit_drift: float  # max |logits(generate) - logits(teacher-forced forward)|, both the model's
    bound_replay: float  # largest |Δ| rounding explains, with replay (see rounding_bound)
    bound_full: float  # largest |Δ - log(kept mass)| rounding explains, without
    versions: Dict[str, str]
    order: Optional[Dict[str, Any]] = None  # order_check(): vLLM's order against generate's, with min_p
    data: Optional[TokenData] = field(default=None, repr=False)

    @property
    def within_rounding(self) -> bool:
        return (self.replay.outside_kept == 0 and self.replay.max_abs <= self.bound_replay
                and self.max_mass_error <= self.bound_full)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready: everything but the per-token tensors."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "data"}
        out["settings"] = dataclasses.asdict(self.settings)
        out["replay"] = dataclasses.asdict(self.replay)
        out["full"] = dataclasses.asdict(self.full)
        out["within_rounding"] = self.within_rounding
        return out


def metrics(trainer: torch.Tensor, generation: torch.Tensor) -> Metrics:
    """:class:`Metrics` of per-token logprobs ``trainer`` against ``generation`` (same shape)."""
    trainer, generation = trainer.double().flatten(), generation.double().flatten()
    finite = torch.isfinite(trainer)
    t, g = trainer[finite], generation[finite]
    d = t - g
    n = int(d.numel())
    if n == 0:
        nan = float("nan")
        return Metrics(0, nan, nan, nan, nan, nan, nan, nan, int((~finite).sum()))
    ratio = d.exp()
    lo, hi = RATIO_BAND
    if n > 1 and float(t.std()) > 0 and float(g.std()) > 0:
        pearson = float(torch.corrcoef(torch.stack([t, g]))[0, 1])
    else:
        pearson = float("nan")
    return Metrics(
        tokens=n,
        mean_abs=float(d.abs().mean()),
        max_abs=float(d.abs().max()),
        mult_prob_error=float(d.abs().exp().mean()),
        k3_kl=float((ratio - 1 - d).mean()),
        pearson=pearson,
        outside_band=float(((ratio < lo) | (ratio > hi)).double().mean()),
        mean_ratio=float(ratio.mean()),
        outside_kept=int((~finite).sum()),
    )


# -- models --------------------------------------------------------------------------------------

def _transformers():
    try:
        import transformers
    except ImportError:
        raise ParityError('the parity check needs transformers: pip install -e ".[parity]" '
                          '(or pip install "logprob-registry[parity]")') from None
    return transformers


def tiny_models(seed: int = 0, dtype: torch.dtype = torch.float32) -> Dict[str, Any]:
    """A randomly initialised small Llama and Gemma-2 (with ``final_logit_softcapping=30``, Gemma-2's
    value), built from configs, nothing downloaded; the same weights for the same seed. The lm_head
    is redrawn so that the logits spread like a trained model's (:data:`TINY_LOGIT_STD`)."""
    tf = _transformers()
    common = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    configs = {
        "llama": (tf.LlamaConfig(**common, tie_word_embeddings=False), tf.LlamaForCausalLM),
        "gemma2": (tf.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                   tie_word_embeddings=False), tf.Gemma2ForCausalLM),
    }
    models = {}
    for i, name in enumerate(TINY_MODELS):
        config, cls = configs[name]
        config._attn_implementation = "eager"
        torch.manual_seed(seed + i)
        model = cls(config).eval()
        head = model.get_output_embeddings().weight
        g = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            head.copy_(torch.randn(head.shape, generator=g) * (TINY_LOGIT_STD / config.hidden_size ** 0.5))
        models[f"tiny-{name}"] = model.to(dtype)
    return models


def load_model(path: str, dtype: torch.dtype, device: str) -> Any:
    """A causal LM from a local directory (``from_pretrained``, nothing downloaded)."""
    tf = _transformers()
    if not os.path.isdir(path):
        raise ParityError(f"{path!r} is not a directory: give a local directory with config.json and the "
                          "weights, as save_pretrained writes it (nothing is downloaded)")
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ParityError(f"cannot load a causal LM from {path!r}: {exc} (give a local directory with "
                          "config.json and the weights, as save_pretrained writes it)") from None
    return model.to(device).eval()


def model_softcap(model: Any) -> Optional[float]:
    """The model's ``final_logit_softcapping`` (Gemma-2, Gemma-3), or None."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    return float(cap) if cap else None


# -- one model -----------------------------------------------------------------------------------

def _softcapped(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """What the model's forward does after lm_head (Gemma-2: three separately rounded ops)."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def _generate(model: Any, prompt: torch.Tensor, settings: Settings, eos: Any) -> Tuple[torch.Tensor, ...]:
    """Sample one prompt; returns (new ids (n,), raw logits (n, V) fp32, processed scores (n, V))."""
    tf = _transformers()
    config = tf.GenerationConfig(
        do_sample=True, temperature=settings.temperature, top_k=settings.top_k or 0,
        top_p=settings.top_p if settings.top_p is not None else 1.0, min_p=settings.min_p,
        max_new_tokens=settings.new_tokens,
        eos_token_id=eos, pad_token_id=eos if isinstance(eos, int) else 0,
        output_scores=True, output_logits=True, return_dict_in_generate=True)
    saved = model.generation_config
    # generate() fills unset values from the model's own generation_config (a repetition penalty,
    # say), which would add processors to the scores: give it a blank one while it runs.
    model.generation_config = tf.GenerationConfig()
    try:
        with torch.no_grad():
            out = model.generate(prompt[None], generation_config=config)
    finally:
        model.generation_config = saved
    ids = out.sequences[0, prompt.numel():]
    n = len(out.scores)
    return ids[:n], torch.stack(out.logits)[:, 0].float(), torch.stack(out.scores)[:, 0].float()


def _check_scores(logits: torch.Tensor, scores: torch.Tensor, temperature: float, model: str) -> torch.Tensor:
    """The kept mask; a ParityError if generate processed the logits beyond temperature and masking."""
    kept = torch.isfinite(scores)
    if not torch.equal(scores[kept], (logits / temperature)[kept]):
        raise ParityError(f"{model}: generate() changed the logits beyond temperature, top_k, top_p and min_p "
                          "(another logits processor ran, such as a repetition penalty); the parity "
                          "check only replays temperature, top_k, top_p and min_p")
    return kept


def _lm_head(model: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ParityError(f"{type(model).__name__} has no output embedding (lm_head) to replay from")
    return head.weight, getattr(head, "bias", None)


def _selected_backend(inputs: tuple, temperature: float, sampler: Dict[str, Any]) -> str:
    """The backend the registry selects for the replay call :func:`_registry` makes on ``inputs``."""
    from .call import validate
    from .registry import get_registry

    *tensors, keywords = inputs
    op, names = (("logprobs_from_hidden", ("hidden", "weight", "labels")) if len(tensors) == 3
                 else ("logprobs", ("logits", "labels")))
    with torch.no_grad():
        call = validate(op, dict(zip(names, tensors), temperature=temperature, **keywords, **sampler))
    return get_registry().select(call.key).name


def check_model(model: Any, name: str = "model", settings: Settings = Settings(),
                prompts: Optional[Sequence[torch.Tensor]] = None, backend: Optional[str] = None) -> ModelReport:
    """Sample with ``model.generate`` and compare the registry's teacher-forced log-probabilities
    of the sampled tokens with the generation's processed ones; see the module docstring.

    ``prompts`` are 1-D id tensors (default: ``settings.prompts`` random ones of
    ``settings.prompt_length`` ids, from ``settings.seed``). ``backend`` forces a registry backend.
    """
    settings = settings.check()
    device = next(model.parameters()).device
    weight, bias = _lm_head(model)
    vocab = weight.shape[0]
    cap = model_softcap(model)
    dtype = weight.dtype
    if prompts is None:
        g = torch.Generator().manual_seed(settings.seed)
        prompts = list(torch.randint(0, vocab, (settings.prompts, settings.prompt_length), generator=g))
    if not len(prompts) or any(p.numel() == 0 for p in prompts):
        raise ParityError("give at least one prompt, each of at least one token id")
    eos = getattr(model.generation_config, "eos_token_id", None)
    T = settings.temperature
    # generate()'s warpers, replayed in their own order (sampler="hf", docs/sampler.md)
    sampler = dict(top_k=settings.top_k, top_p=settings.top_p if settings.top_p not in (None, 1.0) else None,
                   min_p=settings.min_p or None, sampler="hf")
    logits_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else None

    rows: Dict[str, List[torch.Tensor]] = {k: [] for k in ("gen", "replay", "full", "mass", "count")}
    sequences: List[torch.Tensor] = []
    drift = product = max_logit = 0.0
    most_kept, source = 0, "hidden"
    torch.manual_seed(settings.seed)
    for prompt in prompts:
        prompt = prompt.to(device=device, dtype=torch.long).flatten()
        ids, logits, scores = _generate(model, prompt, settings, eos)
        kept = _check_scores(logits, scores, T, name)
        rows["gen"].append(scores.log_softmax(-1).gather(-1, ids[:, None])[:, 0].double())
        rows["mass"].append((logits.double() / T).softmax(-1).masked_fill(~kept, 0).sum(-1))
        rows["count"].append(kept.sum(-1).double())
        max_logit = max(max_logit, float(logits.abs().max()))
        most_kept = max(most_kept, int(kept.sum(-1).max()))

        # Teacher-forced: the hidden state before each sampled token, through the registry.
        seq = torch.cat([prompt, ids])
        sequences.append(seq.cpu())
        rows_at = slice(prompt.numel() - 1, seq.numel() - 1)
        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=seq[None, :-1]).last_hidden_state[0]
            forward = model(input_ids=seq[None, :-1]).logits[0, rows_at]
            mine = _softcapped(torch.nn.functional.linear(hidden, weight, bias), cap)[rows_at]
            hidden = hidden[rows_at]
        drift = max(drift, float((forward.float() - logits).abs().max()))
        if not rows["replay"]:
            # Does the forward do more than lm_head and the softcap (a logit scale, say)? Then replay
            # from its logits instead.
            tolerance = _product_bound(hidden, weight, bias) + 8 * _unit(dtype) * float(forward.abs().max())
            if float((mine.float() - forward.float()).abs().max()) > tolerance:
                source = "logits"
        if source == "hidden":
            product = max(product, _product_bound(hidden, weight, bias))
            inputs = (hidden, weight, ids, dict(bias=bias, softcap=cap, logits_dtype=logits_dtype))
        else:
            inputs = (forward, ids, {})
        rows["replay"].append(_registry(inputs, T, backend, sampler))
        rows["full"].append(_registry(inputs, T, backend, {}))

    data = TokenData(sequences, int(prompts[0].numel()),
                     *(torch.cat(rows[k]).cpu() for k in ("gen", "replay", "full", "mass", "count")))
    replay, full = metrics(data.replay, data.generation), metrics(data.full, data.generation)
    u = _unit(dtype)
    return ModelReport(
        model=name, dtype=dtype_name(dtype), softcap=cap, vocab_size=vocab, settings=settings,
        backend=backend or _selected_backend(inputs, T, sampler),
        source=source, replay=replay, full=full,
        predicted_mean_ratio=float(data.kept_mass.mean()),
        observed_mean_ratio=full.mean_ratio,
        max_mass_error=float((data.full - data.generation - data.kept_mass.log()).abs().max()),
        mean_kept_tokens=float(data.kept_count.mean()),
        logit_drift=drift,
        bound_replay=rounding_bound(drift, product, max_logit, T, most_kept, u),
        bound_full=rounding_bound(drift, product, max_logit, T, vocab, u),
        versions=_versions(), order=order_check(), data=data,
    )


#: The constructed case of :func:`order_check`: min_p drops a thin tail, which changes what top_p
#: sees in vLLM's order (min_p first) but not in transformers' (top_p first).
ORDER_CASE = dict(temperature=0.8, top_k=20, top_p=0.93, min_p=0.1)


def order_logits(rows: int = 64, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    """Logits on which vLLM's and transformers' orders keep different tokens under
    :data:`ORDER_CASE`: probabilities (after the temperature) of about 0.5, 0.35 and 0.06 over a
    tail of 0.09 spread over the rest. vLLM drops the tail (min_p), renormalises, and top_p then
    drops the 0.06 token; transformers' top_p sees the tail's mass first and keeps it."""
    g = torch.Generator().manual_seed(seed)
    head = torch.tensor([0.5, 0.35, 0.06]) * (1 + 0.05 * torch.rand(rows, 3, generator=g))
    tail = torch.rand(rows, vocab - 3, generator=g) + 0.5
    probs = torch.cat([head, 0.09 * tail / tail.sum(-1, keepdim=True)], -1)
    x = ORDER_CASE["temperature"] * probs.log()
    return x[:, torch.randperm(vocab, generator=g)]


def order_check() -> Dict[str, Any]:
    """Why the replay uses ``sampler="hf"``: on :func:`order_logits` with :data:`ORDER_CASE`, the
    kept sets of ``generate``'s own warpers, of the registry's ``"hf"`` order and of its ``"vllm"``
    order; how many positions each disagrees with ``generate`` at."""
    from transformers.generation import logits_process as lp

    from . import truncation

    x = order_logits()
    c = ORDER_CASE
    scores = x.float()
    for warper in (lp.TemperatureLogitsWarper(c["temperature"]), lp.TopKLogitsWarper(c["top_k"]),
                   lp.TopPLogitsWarper(c["top_p"]), lp.MinPLogitsWarper(c["min_p"])):
        scores = warper(None, scores)
    generate = torch.isfinite(scores)
    differ = {order: int((truncation.kept_tokens(x, sampler=order, **c) != generate).any(-1).sum())
              for order in ("hf", "vllm")}
    return dict(case=dict(c), positions=int(x.shape[0]), hf_differs=differ["hf"], vllm_differs=differ["vllm"])


def _registry(inputs: tuple, temperature: float, backend: Optional[str], sampler: Dict[str, Any]) -> torch.Tensor:
    """The registry's logprobs of the sampled tokens: ``logprobs_from_hidden`` on
    ``(hidden, weight, ids, keywords)``, or ``logprobs_from_logits`` on ``(logits, ids, keywords)``."""
    import logprob_registry as lr

    *tensors, keywords = inputs
    op = lr.logprobs_from_hidden if len(tensors) == 3 else lr.logprobs_from_logits
    with torch.no_grad():
        return op(*tensors, temperature=temperature, backend=backend, **keywords, **sampler).double()


def _unit(dtype: torch.dtype) -> float:
    """Unit roundoff of a float dtype (half the distance from 1 to the next number)."""
    return torch.finfo(dtype).eps / 2


def _product_bound(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> float:
    """How far two fp32 evaluations of ``hidden @ weight.T + bias`` in different orders can differ
    (Higham's dot-product bound ``γ_H Σ|h||w|``, twice: one per evaluation)."""
    h = hidden.shape[-1] + (bias is not None)
    gamma = h * _U32 / (1 - h * _U32)
    size = hidden.detach().abs().double() @ weight.detach().abs().double().T
    if bias is not None:
        size = size + bias.detach().abs().double()
    return 2 * gamma * float(size.max())


def rounding_bound(drift: float, product: float, max_logit: float, temperature: float, terms: int,
                   unit: float = _U32) -> float:
    """The largest ``|Δ|`` between two log-softmaxes of the same kept tokens that rounding explains.

    Each logprob is ``z_j / T - logsumexp(z / T)`` over the kept tokens, so ``|Δ| <= 2 max|δz| / T``
    plus the rounding of each evaluation. ``δz`` is the logits' difference: ``drift`` (the model's
    generation forward against its teacher-forced one, measured), ``product`` (the registry's
    ``hidden @ weight.T`` against the model's, :func:`_product_bound`) and, per side, rounding to the
    logits' dtype and the softcap's three ops (``4 unit |z|``). Each side's log-softmax adds
    ``3 u32 |z| / T`` (division, shift, subtraction) and ``terms * u32`` (the sum over the kept
    tokens, relative error at most ``terms * u32``, through the log)."""
    dz = drift + product + 2 * 4 * unit * max_logit
    return 2 * dz / temperature + 2 * (3 * _U32 * max_logit / temperature + terms * _U32)


def _versions() -> Dict[str, str]:
    import logprob_registry

    out = {"torch": torch.__version__, "logprob_registry": logprob_registry.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


# -- text ----------------------------------------------------------------------------------------

_COLUMNS = ("mean|Δ|", "max|Δ|", "mean exp|Δ|", "k3 KL", "pearson", "mean ratio", "ratio∉[0.9,1.1]")


def _g(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def format_report(report: ModelReport) -> str:
    """The report of one model as text (what ``logprob-registry parity`` prints)."""
    s = report.settings
    cap = f"softcap {report.softcap:g}" if report.softcap else "no softcap"
    prompts = s.prompts if report.data is None else len(report.data.sequences)
    head = (f"{report.model} ({report.dtype}, V={report.vocab_size}, {cap}): {prompts} prompts, "
            f"{report.replay.tokens + report.replay.outside_kept} sampled tokens; temperature {s.temperature:g}, "
            f"top_k {s.top_k}, top_p {s.top_p}, min_p {s.min_p}; backend {report.backend} ({report.source})")
    rows = [("", *_COLUMNS)]
    for label, m in (("with replay", report.replay), ("without replay", report.full)):
        rows.append((label, _g(m.mean_abs), _g(m.max_abs), f"{m.mult_prob_error:.7f}", _g(m.k3_kl),
                     f"{m.pearson:.7f}", f"{m.mean_ratio:.7f}", f"{m.outside_band:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    verdict = "within" if report.within_rounding else "NOT within"
    lines = [head, *("  " + t for t in table),
             f"  with replay: largest |Δ| {report.replay.max_abs:.3g}, {verdict} what rounding explains "
             f"({report.bound_replay:.3g}; the model's own logits drift {report.logit_drift:.3g} between "
             "generate and the teacher-forced forward)",
             f"  without replay: mean ratio {report.observed_mean_ratio:.7f}, predicted by the mean kept mass "
             f"{report.predicted_mean_ratio:.7f} (largest per-token |log ratio - log kept mass| "
             f"{report.max_mass_error:.3g}, bound {report.bound_full:.3g}); {report.mean_kept_tokens:.1f} tokens "
             "kept per position on average"]
    if report.order is not None:
        o, c = report.order, report.order["case"]
        case = ", ".join(f"{k} {v:g}" for k, v in c.items())
        lines.append(f'  order: replayed as sampler="hf" (generate: top_k, top_p, then min_p); on a constructed case '
                     f"({case}; {o['positions']} positions) generate's warpers keep other tokens than "
                     f"\"hf\" at {o['hf_differs']} positions and than \"vllm\" (min_p first) at {o['vllm_differs']}")
    if report.replay.outside_kept:
        lines.append(f"  {report.replay.outside_kept} sampled tokens fall outside the replayed kept set "
                     "(ratio 0), left out of the numbers above")
    return "\n".join(lines)
