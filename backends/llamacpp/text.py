"""Pure-Python text handling for the engine: UTF-8 piece decoding, stop strings, ChatML.

Nothing here touches llama.cpp, so it is unit-testable on its own.
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping, Sequence

from daemon.backend import InvalidArgument


class PieceDecoder:
    """Token pieces (bytes) in, complete characters out.

    A byte-fallback tokenizer emits one UTF-8 byte per token for characters it has no
    piece for, so a single character can arrive split over several tokens. The
    incremental decoder keeps the incomplete tail until the rest arrives; invalid bytes
    become U+FFFD instead of failing the whole stream.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, piece: bytes) -> str:
        return self._decoder.decode(piece)

    def flush(self) -> str:
        """End of stream: an incomplete trailing sequence becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Cut the stream at the first stop string, never emitting any part of it.

    Text that could be the beginning of a stop string is held back until the next piece
    shows whether it is one; `flush` releases it when the stream ends without a match.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        # The stop string that was hit: the earliest in the text, the first listed of those
        # starting there (llama-server's stopping_word).
        self.matched = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        if not self._stops:
            return text, False
        buffer = self._held + text
        # Emitted text never held a partial match, so a stop can only start in `buffer`.
        hits = [(i, stop) for stop in self._stops if (i := buffer.find(stop)) >= 0]
        if hits:
            self._held = ""
            at = min(i for i, _ in hits)
            self.matched = next(stop for i, stop in hits if i == at)
            return buffer[:at], True
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest


class ReasoningTracker:
    """Whether an output is inside its reasoning, from the token texts as they come (control
    tokens' texts too): an opening tag enters it, a closing tag (one of several) leaves it, and
    a later opening tag enters it again (some models write several reasoning blocks), as
    llama-server's reasoning-budget sampler tracks it. Tags may span tokens; a piece may hold
    several."""

    def __init__(self, opening: bytes, closing: tuple[bytes, ...], *, inside: bool) -> None:
        self.opening = opening
        self.closing = tuple(tag for tag in closing if tag)
        self.inside = inside
        self.ended_by = b""  # the closing tag that last left the reasoning
        self._tail = b""  # the output's end, shorter than the tags looked for

    def feed(self, piece: bytes) -> bool:
        """Take the next token's text; whether the output is now on the other side."""
        before = self.inside
        text = self._tail + piece
        while True:
            tags = self.closing if self.inside else (self.opening,) if self.opening else ()
            found = [(at, tag) for tag in tags if (at := text.find(tag)) >= 0]
            if not found:
                longest = max((len(tag) for tag in tags), default=1)
                self._tail = text[max(0, len(text) - longest + 1) :] if longest > 1 else b""
                break
            at, tag = min(found)
            if self.inside:
                self.ended_by = tag
            self.inside = not self.inside
            text = text[at + len(tag) :]
        return self.inside != before


def chatml(messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
    """ChatML, the fallback when a model ships no chat template llama.cpp understands."""
    parts = [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in message_pairs(messages)]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def message_pairs(messages: Sequence[Mapping[str, str]]) -> list[tuple[str, str]]:
    """(role, content) of each OpenAI-style message; the error names the bad message."""
    pairs = []
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidArgument(f"messages[{index}]: 'role' must be a non-empty string")
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{index}]: 'content' must be a string")
        pairs.append((role, content))
    return pairs
