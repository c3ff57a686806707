"""The conformance suite every backend must pass (issue 3 builds it out)."""
