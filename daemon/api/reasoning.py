"""A thinking model's reply split into its reasoning and its answer, whole or as it streams.

A model whose chat template reasons in tags (the backend's `thinking_tags()`, such as
`<think>` / `</think>`) writes `<think>...</think>` before its answer, or only `...</think>`
when the prompt already ends with the opening tag (DeepSeek R1's templates). As llama-server
(`reasoning_format: deepseek`, its default) and Ollama (`think: true`) read it:
- the reasoning opens only at the very start of the output (after whitespace); a tag later on
  is the answer's text, and an output that does not open with the tag is all answer;
- it runs to the first closing tag; whitespace after that tag is not part of the answer;
- an output that ends before the closing tag (a length cut) is all reasoning (a start of the
  closing tag at its very end left out).
They differ in one place: Ollama drops the whitespace that starts the reasoning, llama-server
keeps it, with the whitespace the prompt put after an opening tag it wrote (`trim`). Some of
llama-server's parsers for newer formats differ again (Qwen 3.5's trims; Gemma 4's thought
channel trims and keeps the whitespace after the closing tag as the answer's, `keep_after`):
the tool syntax of the model says which (`tool_syntax.Syntax`).

Streamed, a piece that might still become a tag is held back until it is known, so the streamed
parts add up to the whole reply's.
"""

from __future__ import annotations

import enum

from daemon.backend import GenerateParams


class _State(enum.Enum):
    OPENING = enum.auto()  # before the reasoning: is the output opening it?
    REASONING = enum.auto()
    AFTER = enum.auto()  # the closing tag went by: whitespace there is not the answer's
    ANSWER = enum.auto()


def opened_by(prompt: str, tags: tuple[str, str]) -> str | None:
    """The whitespace after the opening tag when `prompt` ends with it (plus whitespace), so
    the output starts inside the reasoning; None when it does not (no tags: None)."""
    opening = tags[0]
    if not opening:
        return None
    body = prompt.rstrip()
    if not body.endswith(opening):
        return None
    return prompt[len(body):]


class ThinkingSplit:
    """One reply's reasoning and answer. `opened`: what `opened_by` found in the prompt;
    `trim`: drop the whitespace that starts the reasoning (Ollama) rather than keep it;
    `ends`: a marker that also ends the reasoning and begins the answer (Qwen 3.5's
    `<tool_call>`: llama-server reads a call written inside the reasoning as a call);
    `keep_after`: the whitespace after the closing tag is the answer's (Gemma 4's channel)."""

    def __init__(
        self, tags: tuple[str, str], *, opened: str | None, trim: bool, ends: str = "", keep_after: bool = False
    ) -> None:
        self._opening, self._closing = tags
        self._ends = ends
        self._keep_after = keep_after
        self._trim = trim
        self._held = ""
        if opened is None:
            self._state = _State.OPENING
        else:
            self._state = _State.REASONING
            self._held = "" if trim else opened
        # The reasoning's start is still whitespace to drop.
        self._eating = trim
        self._closed = False

    @property
    def began(self) -> bool | None:
        """Whether the reply opened with reasoning (None: not known yet, the output so far is
        whitespace or a start of the opening tag)."""
        if self._state is _State.OPENING:
            return None
        return self._state is not _State.ANSWER or self._closed

    @property
    def closed(self) -> bool:
        """Whether the closing tag went by."""
        return self._closed

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """The reasoning and the answer `text` adds (either may be ""); `final`: nothing more
        comes, so nothing is held back."""
        pending, self._held = self._held + text, ""
        reasoning = ""
        if self._state is _State.OPENING:
            stripped = pending.lstrip()
            if stripped.startswith(self._opening):
                pending, self._state = stripped[len(self._opening):], _State.REASONING
            elif self._opening.startswith(stripped) and not final:
                self._held = pending  # whitespace or a start of the tag: not known yet
                return "", ""
            else:
                self._state = _State.ANSWER
        if self._state is _State.REASONING:
            if self._eating:
                pending = pending.lstrip()
                self._eating = not pending
            end = pending.find(self._closing)
            cut = pending.find(self._ends) if self._ends else -1
            if cut >= 0 and (end < 0 or cut < end):
                reasoning, pending, self._state = pending[:cut], pending[cut:], _State.ANSWER
                self._closed = True
            elif end >= 0:
                reasoning, pending, self._state = pending[:end], pending[end + len(self._closing):], _State.AFTER
                self._closed = True
            else:
                # A start of the closing tag at the end of a reply cut short is no reasoning
                # (llama-server leaves it out too).
                keep = max(overlap(pending, self._closing), overlap(pending, self._ends))
                reasoning, self._held, pending = pending[: len(pending) - keep], pending[len(pending) - keep:], ""
                if final:
                    self._held = ""
        if self._state is _State.AFTER:
            pending = pending if self._keep_after else pending.lstrip()
            if pending:
                self._state = _State.ANSWER
        return reasoning, pending if self._state is _State.ANSWER else ""


def split(
    text: str, tags: tuple[str, str], *, opened: str | None, trim: bool, ends: str = "", keep_after: bool = False
) -> tuple[str, str]:
    """A whole reply's reasoning and answer (ThinkingSplit, fed once)."""
    return ThinkingSplit(tags, opened=opened, trim=trim, ends=ends, keep_after=keep_after).feed(text, final=True)


def hold_grammar_after(params: GenerateParams, tags: tuple[str, str], prompt: str) -> None:
    """An output grammar (response_format, a generic or required tool reply) of a thinking
    model holds after its reasoning, as llama-server's and Ollama's do: from the closing tag
    on where the prompt opened the reasoning (DeepSeek R1's templates; else the model would
    write its answer inside the reasoning), after the reasoning the model may open itself
    (Qwen 3, Gemma 4) otherwise, and at once where the prompt closed it (thinking turned off).
    A lazy tool frame has its own trigger."""
    lazy = params.tool_calls is not None and params.tool_calls.lazy
    if not tags[0] or lazy or not (params.json_schema or params.grammar or params.tool_calls):
        return
    if opened_by(prompt, tags) is not None:
        params.grammar_after = tags[1]
    elif not prompt.rstrip().endswith(tags[1]):
        params.grammar_reasoning = tags


def overlap(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag` (shorter than it): what
    a stream holds back until it knows whether the tag is coming."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
