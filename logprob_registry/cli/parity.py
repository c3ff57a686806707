"""``logprob-registry parity``: sample from a Hugging Face causal LM and compare the registry's
teacher-forced log-probabilities of the sampled tokens with the generation's processed ones, with
and without replaying top_k/top_p (:mod:`logprob_registry.parity` does the work; it needs
``transformers``: ``pip install -e ".[parity]"``).

Exit status: 0 when every model's replay is within what fp32 rounding explains, 1 when one is not,
2 for a usage error (including transformers missing or a model that cannot be loaded).
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="PATH", help="a local directory with a causal LM (save_pretrained's layout)")
    which.add_argument("--tiny", action="store_true",
                       help="a randomly initialised small Llama and Gemma-2 (softcap 30), built from configs")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    parser.add_argument("--top-k", type=int, default=50, metavar="K", help="top_k, 0 for none (default 50)")
    parser.add_argument("--top-p", type=float, default=0.8, metavar="P", help="top_p, 1 for none (default 0.8)")
    parser.add_argument("--min-p", type=float, default=0.0, metavar="P", help="min_p, 0 for none (default 0)")
    parser.add_argument("--new-tokens", type=int, default=16, metavar="N",
                        help="tokens sampled per prompt (default 16)")
    parser.add_argument("--prompts", type=int, default=4, metavar="N", help="random prompts (default 4)")
    parser.add_argument("--prompt-length", type=int, default=8, metavar="N", help="ids per prompt (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts, the sampling and the tiny models")
    parser.add_argument("--dtype", default="float32", help="model dtype (default float32)")
    parser.add_argument("--device", default=None, help="device, such as cpu or cuda:0 (default: cuda if available)")
    parser.add_argument("--backend", default=None, metavar="NAME", help="force this registry backend")
    parser.add_argument("--json", metavar="FILE", help="write the reports as JSON ('-': to stdout, text to stderr)")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..dtypes import parse_dtype
    from ..parity import ParityError, Settings, check_model, format_report, load_model, tiny_models
    from ..registry import NoEligibleBackendError, get_registry

    out = sys.stderr if args.json == "-" else sys.stdout
    try:
        if args.backend is not None:
            get_registry().get(args.backend)  # an unknown name: say so before building any model
        dtype = parse_dtype(args.dtype)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        settings = Settings(temperature=args.temperature, top_k=args.top_k or None,
                            top_p=None if args.top_p == 1 else args.top_p, min_p=args.min_p or None,
                            new_tokens=args.new_tokens,
                            prompts=args.prompts, prompt_length=args.prompt_length, seed=args.seed).check()
        if args.tiny:
            models = {k: m.to(device) for k, m in tiny_models(args.seed, dtype).items()}
        else:
            models = {args.model: load_model(args.model, dtype, device)}
        reports = []
        for name, model in models.items():
            reports.append(check_model(model, name, settings, backend=args.backend))
            print(format_report(reports[-1]), file=out, flush=True)
    except (ParityError, ValueError, NoEligibleBackendError) as exc:
        print(f"logprob-registry parity: {exc}", file=sys.stderr)
        return 2
    doc = {"reports": [r.to_dict() for r in reports]}
    if args.json == "-":
        print(json.dumps(doc, indent=1))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r.within_rounding for r in reports) else 1
