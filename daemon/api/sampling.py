"""Sampling fields as the OpenAI and Ollama routes both read them into GenerateParams (and
llama-server's `samplers`, for every route that takes llama-server's fields)."""

from __future__ import annotations

from daemon.backend import DEFAULT_SAMPLERS, SAMPLERS
from daemon.errors import InvalidArgument

# The llama.cpp engine keeps 32 bits of a seed, and its all-ones value means "random": a seed
# beyond this would silently become another one.
MAX_SEED = 2**32 - 2


def seed(value: int | None, field: str) -> int | None:
    """The seed to sample with; None (random) for -1, as llama-server and Ollama read it."""
    if value is None or value == -1:
        return None
    if not 0 <= value <= MAX_SEED:
        raise InvalidArgument(f"{field} must be -1 (random) or between 0 and {MAX_SEED}, got {value}")
    return value


# llama.cpp takes counts of tokens (top-k, the penalties' window) as 32-bit integers: a larger
# one would reach it as another number (2**32 + 1 as 1).
MAX_INT32 = 2**31 - 1


def count(value: int, field: str, low: int, meaning: str = "") -> int:
    """A count of tokens llama.cpp takes as a 32-bit integer, at least `low`; `meaning` says
    what the one value below 0 means (-1: "-1 (the context) or "), for the error."""
    if not low <= value <= MAX_INT32:
        shown = 0 if meaning else low
        raise InvalidArgument(f"{field} must be {meaning}between {shown} and {MAX_INT32}, got {value}")
    return value


def n_probs(value: int | None, logprobs: int | None) -> int | None:
    """llama-server's `n_probs` (alternatives per token, 0..20), with `logprobs` sent beside it
    under the same meaning; None when neither is sent."""
    if value is not None and logprobs is not None and value != logprobs:
        raise InvalidArgument("n_probs and logprobs disagree; send one of them")
    count = value if value is not None else logprobs
    if count is not None and not 0 <= count <= 20:
        raise InvalidArgument(f"n_probs must be between 0 and 20, got {count}")
    return count


def stop_strings(value: str | list[str], field: str) -> list[str]:
    """One stop string or several. An empty one is refused: llama-server and Ollama's runner
    stop at once on it, the engine would drop it; neither is what was asked."""
    stops = [value] if isinstance(value, str) else list(value)
    if "" in stops:
        raise InvalidArgument(f"{field}: an empty string is not a stop string")
    return stops


# llama.cpp's sampler names (common_sampler_types_from_names): each canonical name with an
# underscore also spelt with a dash and without it ("top-k", "topk"), and three more aliases.
# Matched after ASCII lowercasing, as llama.cpp's ::tolower does.
_SAMPLER_ALIASES = {
    **{name: name for name in (*SAMPLERS, "adaptive_p")},
    **{name.replace("_", "-"): name for name in (*SAMPLERS, "adaptive_p") if "_" in name},
    **{name.replace("_", ""): name for name in (*SAMPLERS, "adaptive_p") if "_" in name},
    "nucleus": "top_p",
    "temp": "temperature",
    "typ": "typ_p",
}
# llama.cpp's one-letter codes (common_sampler_type_to_chr), case-sensitive as there.
_SAMPLER_CODES = {
    "e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
    "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill", "a": "adaptive_p",
}
_CODES = ", ".join(f"{code} ({name})" for code, name in _SAMPLER_CODES.items() if name != "adaptive_p")
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def sampler_order(value: list[str] | str | None, field: str = "samplers") -> tuple[str, ...]:
    """llama-server's `samplers`: a list of sampler names (any case, its aliases too) or a
    string of one-letter codes ("edskypmxt" is its default order), as GenerateParams.samplers
    (canonical names, in order, repeats kept); None (the field absent or null): the default
    order. llama-server skips a name or code it does not know (with a log line); here it is a
    400 naming it. "adaptive_p" is a 400 too: it does nothing without `adaptive_target`, which
    no route here takes. An empty list or string is llama-server's too: no sampler but the
    biases, a draw from the model's own distribution."""
    if value is None:
        return DEFAULT_SAMPLERS
    order = []
    for index, given in enumerate(value):
        where = f"{field}[{index}]"
        if isinstance(value, str):
            name = _SAMPLER_CODES.get(given)
            if name is None:
                raise InvalidArgument(f"{where}: unknown sampler code {given!r} in {value!r}; the codes are {_CODES}")
        else:
            name = _SAMPLER_ALIASES.get(given.translate(_ASCII_LOWER))
            if name is None:
                raise InvalidArgument(
                    f"{where}: unknown sampler {given!r}; the samplers are {', '.join(SAMPLERS)} (also "
                    "spelt with '-' for '_' or without it, e.g. top-k or topk; nucleus, temp, typ)"
                )
        if name == "adaptive_p":
            raise InvalidArgument(
                f"{where}: {given!r} (adaptive-p) is not offered: it needs adaptive_target, "
                "which this server does not take"
            )
        order.append(name)
    return tuple(order)
