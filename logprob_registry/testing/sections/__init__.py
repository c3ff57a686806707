"""Sections of the conformance suite, one mixin class per part of the contract, which
:class:`~logprob_registry.testing.BackendConformance` inherits (:mod:`.distributed`: the
vocabulary-parallel path behind ``process_group=``)."""
