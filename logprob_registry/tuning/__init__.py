"""Measured selection: ``logprob-registry tune`` ranks the eligible backends by their measured
times on this machine (:mod:`.measure`) and writes the ranking to a cache file (:mod:`.cache`),
which selection then follows for the keys it covers. Without a ranking, priority decides."""
