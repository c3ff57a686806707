"""The registry's exceptions and warnings."""


class NoEligibleBackendError(RuntimeError):
    """No backend, or not the one explicitly asked for, can run an op for the given tensors."""


class BackendFallbackWarning(RuntimeWarning):
    """An automatically chosen backend failed at run time and another one took over."""
