"""llama-server's `timings` object (prompt and generation counts, times and rates), measured
at the route as a sequence's chunks come: the prompt from handing the request to the engine
to its first token's chunk (a wait for a free slot included), generation from then to the
last chunk. Shared by its native /completion and the OpenAI routes' `timings_per_token`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from daemon.backend import GenerateChunk


@dataclass
class Clock:
    """One sequence's times and counts so far."""

    started: float = 0.0  # when the request went to the engine (time.monotonic)
    first_at: float = 0.0
    ended_at: float = 0.0
    predicted: int = 0  # tokens the chunks carried
    last: GenerateChunk = field(default_factory=lambda: GenerateChunk(text=""))

    def add(self, chunk: GenerateChunk) -> None:
        if chunk.prompt_progress is not None:
            return  # before the first token: not part of the output
        if not self.first_at:
            self.first_at = time.monotonic()
        self.predicted += len(chunk.token_ids)
        self.last = chunk
        self.ended_at = time.monotonic()


def timings(clock: Clock, progress: tuple[int, int, int, int] | None = None) -> dict[str, Any]:
    """What there is so far: during the prompt (`progress`, a progress chunk's) its tokens
    evaluated and the time until now, no generation; after, the generation until the last
    chunk, and at the end llama-server's count (an end-of-generation token is no chunk's)."""
    last = clock.last
    if progress is not None:
        _, cached, processed, _ = progress
        evaluated, cache_n, predicted = processed - cached, cached, clock.predicted
        # Nothing evaluated yet (the slot's first event): no prompt time, as llama-server's.
        prompt_ms = (time.monotonic() - clock.started) * 1000 if processed > cached else 0.0
        predicted_ms = 0.0
    else:
        evaluated, cache_n, predicted = last.prompt_tokens - last.cached_tokens, last.cached_tokens, clock.predicted
        if last.finish_reason is not None:
            predicted = last.completion_tokens
        prompt_ms = (clock.first_at - clock.started) * 1000
        predicted_ms = (clock.ended_at - clock.first_at) * 1000
    # As llama-server: the first token comes with the prompt's logits, so rates count the rest.
    steps = max(predicted - 1, 0)
    return {
        "cache_n": cache_n,
        "prompt_n": evaluated, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / evaluated if evaluated else 0.0,
        "prompt_per_second": 1e3 / prompt_ms * evaluated if prompt_ms > 0 else 0.0,
        "predicted_n": predicted, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
        "predicted_per_second": 1e3 / predicted_ms * steps if predicted_ms > 0 else 0.0,
    }


def progress_json(progress: tuple[int, int, int, int]) -> dict[str, int]:
    total, cache, processed, time_ms = progress
    return {"total": total, "cache": cache, "processed": processed, "time_ms": time_ms}
