"""``logprob-registry bench``: every eligible backend, and the textbook baseline, measured side by
side on this machine (time, peak memory, error against float64), for any op of the op table whose
inputs the op table can make (:data:`logprob_registry.opspec.INPUTS`). From Python: :func:`bench`.

- :mod:`.session`   the engine: options to settings, the device, memory and backend checks, the
                    methods of each setting, the run (:class:`Options`, :class:`Session`, :func:`bench`).
- :mod:`.settings`  what one table measures: op, device, dtype, shapes; presets; the inputs by name.
- :mod:`.fit`       whether a setting fits in the device's memory, and the shape that would.
- :mod:`.workload`  the inputs, the calls, the baseline and the float64 comparison (child side).
- :mod:`.timing`    the timing engine (also ``tune``'s): timed calls, the device synchronised.
- :mod:`.memory`    the peak memory of one call (also the conformance suite's).
- :mod:`.child`     the subprocess that times or measures one method.
- :mod:`.measure`   the parent: runs the children, collects, derives the ratios.
- :mod:`.render`    the terminal table and the JSON document.
- :mod:`.plot`      the bar chart (needs matplotlib).
- :mod:`.plugins`   ``--plugin MODULE[:ATTR]``: a plugin registered for one run, parent and children.
"""

from .session import BenchError, Options, Session, bench

__all__ = ["BenchError", "Options", "Session", "bench"]
