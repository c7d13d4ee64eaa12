"""Sampling fields as the OpenAI and Ollama routes both read them into GenerateParams."""

from __future__ import annotations

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


def stop_strings(value: str | list[str], field: str) -> list[str]:
    """One stop string or several. An empty one is refused: llama-server and Ollama's runner
    stop at once on it, the engine would drop it; neither is what was asked."""
    stops = [value] if isinstance(value, str) else list(value)
    if "" in stops:
        raise InvalidArgument(f"{field}: an empty string is not a stop string")
    return stops
