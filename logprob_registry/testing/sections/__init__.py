"""Sections of the conformance suite, one mixin class per part of the contract, which
:class:`~logprob_registry.testing.BackendConformance` inherits (:mod:`.semantics`: the sampler's
processing, candidates, topk and ``logits_dtype``)."""
