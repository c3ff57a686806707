"""``logprob-registry bench``: every eligible backend, and the textbook baseline, measured side by
side on this machine (time, peak memory, error against float64).

- :mod:`.settings`  what one measurement is: op, device, dtype, shape; presets; memory fit.
- :mod:`.workload`  the inputs, the calls, the baseline and the float64 comparison (child side).
- :mod:`.child`     the subprocess that times or measures one method.
- :mod:`.measure`   the parent: runs the children, collects, derives the ratios.
- :mod:`.render`    the terminal table and the JSON document.
- :mod:`.plot`      the PNG bar chart (needs matplotlib).
- :mod:`.plugins`   `--plugin MODULE[:ATTR]`: a plugin registered for one run, parent and children.
"""
