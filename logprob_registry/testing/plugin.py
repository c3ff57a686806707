"""pytest plugin of the conformance suite; import-light (issue 3 builds it out)."""
