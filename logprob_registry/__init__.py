"""Per-token log-probabilities of labels from LLM logits, through the best correct backend for the
device, dtype and torch version at hand. See README.md and docs/."""

from . import call as _call
from . import (
    integrations,  # noqa: F401 - lr.integrations.installed(); each trainer's module imports it lazily
    nn,  # noqa: F401 - lr.nn.LogprobHead; not in __all__: a star import must not shadow torch.nn
)
from .backend import Backend
from .hookspecs import hookimpl
from .layouts import next_token_labels
from .ops import (
    backends,
    entropy_from_logits,
    explain,
    kl_divergence,
    logprobs_and_entropy,
    logprobs_from_hidden,
    logprobs_from_logits,
    select,
    token_stats,
    topk_logprobs,
)
from .opspec import TokenStats
from .registry import BackendFallbackWarning, NoEligibleBackendError, get_registry, strict, use_backend
from .registry import set_process_ranking as _set_process_ranking
from .tuning.cache import Tuning as _Tuning

__version__ = "0.2.0.dev0"

__all__ = [
    "Backend",
    "BackendFallbackWarning",
    "NoEligibleBackendError",
    "TokenStats",
    "backends",
    "entropy_from_logits",
    "explain",
    "get_registry",
    "hookimpl",
    "kl_divergence",
    "logprobs_and_entropy",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "next_token_labels",
    "select",
    "strict",
    "token_stats",
    "topk_logprobs",
    "use_backend",
]

# The user's tuning file ranks the process-wide registry (wired here, above both: the registry
# never imports tuning). Then detect the environment, load the plugins and resolve the default for
# the main device: cheap (no compilation, no kernel launch), never raising, and a broken plugin
# shows up at once.
_set_process_ranking(_Tuning)
get_registry().resolve_default(_call.key_for("logprobs"))
