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
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from daemon.backend import GenerateParams
from daemon.errors import InvalidArgument


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


class Split(Protocol):
    """What the routes read a thinking reply with: ThinkingSplit, or ChannelSplit for gpt-oss."""

    @property
    def began(self) -> bool | None: ...

    @property
    def closed(self) -> bool: ...

    def feed(self, text: str, final: bool) -> tuple[str, str]: ...


# gpt-oss's harmony format (ChannelSplit): a reply is messages, each a header up to
# `<|message|>`, then its text up to `<|end|>`; the messages after the first open with
# `<|start|>assistant` (the prompt wrote the first one's).
HARMONY_START = "<|start|>assistant"
HARMONY_MESSAGE = "<|message|>"
HARMONY_END = "<|end|>"
_NEXT = HARMONY_END + HARMONY_START
_ANALYSIS = "<|channel|>analysis" + HARMONY_MESSAGE
# How ChannelSplit writes a call to a function in the answer it hands on, whichever of the two
# header forms the model wrote: the tool syntax "gpt_oss" reads this (tool_syntax._Harmony).
HARMONY_CALL = "<|channel|>commentary to=functions."
HARMONY_ARGS = " <|constrain|>json" + HARMONY_MESSAGE
# A header is short and on one line; longer, or with a newline, the text is no header.
_HEADER_MAX = 256
# What a header begins with after `<|start|>assistant` (and the first message's, which the
# prompt opened): its channel, or its recipient before it.
_LEADS = ("<|channel|>", "to=")
_RECIPIENT = re.compile(r"(?:^|\s)to=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(r"<\|channel\|>(\w+)")


class ChannelSplit:
    """A gpt-oss reply's reasoning and answer, as llama-server's parser for the format reads them:
    the analysis channel's messages are the reasoning; the final channel's and commentary
    without a recipient (a preamble) are the answer; a message to `functions.NAME` (the
    recipient in the channel's header or before it) is a tool call, handed on in the answer as
    `HARMONY_CALL` NAME `HARMONY_ARGS` ARGUMENTS for the tool syntax to read. Text that is no
    message (a model that does not write the format) is the answer as written; so is a message
    to another recipient (the built-in browser or python tools, which edged does not run).
    A message ends where the next begins (`<|end|><|start|>assistant`); a reply cut short in a
    header says nothing more. Streamed, a header is held back until it is complete, and what
    may begin the next message until known."""

    def __init__(self, *, keep_reasoning: bool = False) -> None:
        # llama-server's `reasoning_format: none` for the format: each analysis message stays in
        # the answer as written, from its channel on (`<|channel|>analysis<|message|>...<|end|>`).
        self._keep = keep_reasoning
        self._held = ""
        self._in_header = True
        self._raw = False  # the rest is the answer as written
        self._kind = ""  # the open message's: "analysis" | "answer"
        self._messages = 0
        self._began: bool | None = None
        self._closed = False

    @property
    def began(self) -> bool | None:
        return self._began

    @property
    def closed(self) -> bool:
        return self._closed

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        pending, self._held = self._held + text, ""
        thought: list[str] = []
        answer: list[str] = []
        while pending:
            if self._raw:
                answer.append(pending)
                break
            if self._in_header:
                at = pending.find(HARMONY_MESSAGE)
                header = pending[:at] if at >= 0 else pending
                if at < 0 and _may_be_header(header):
                    # A reply cut short in a header says nothing more (llama-server's reading).
                    self._held = "" if final else pending
                    break
                opened = self._open(header, answer) if at >= 0 else False
                if not opened:
                    self._raw = True
                    if self._began is None:
                        self._began = False
                    self._closed = True
                    continue
                pending = pending[at + len(HARMONY_MESSAGE):]
                continue
            # A message ends where the next begins; an `<|end|>` before anything else is text,
            # as a grammar that lets the model reason first reads it (its closing tag is the
            # backend's, `<|end|><|start|>assistant`).
            end = pending.find(_NEXT)
            body = pending if end < 0 else pending[:end]
            if end < 0:
                # What may begin the next message is held back, and left out of a reply cut
                # short there, with an `<|end|>` that ends it.
                keep = overlap(pending, _NEXT)
                body, self._held = pending[: len(pending) - keep], "" if final else pending[len(pending) - keep:]
            analysis = self._kind == "analysis"
            (thought if analysis and not self._keep else answer).append(body)
            if end < 0:
                break
            if analysis and self._keep:
                answer.append(HARMONY_END)
            pending, self._in_header = pending[end + len(HARMONY_END):], True
        return "".join(thought), "".join(answer)

    def _open(self, header: str, answer: list[str]) -> bool:
        """Begin the message `header` (the text before its `<|message|>`) opens; False when it
        is no message header."""
        start = header.startswith(HARMONY_START)
        rest = _after_start(header)
        # The last channel: gpt-oss-20b sometimes writes a stray `<|channel|>commentary` first.
        channel = next(reversed(list(_CHANNEL.finditer(rest))), None)
        if (channel is None or not rest.startswith(_LEADS) or len(header) > _HEADER_MAX or "\n" in rest
                or (self._messages and not start)):
            return False
        self._messages += 1
        self._in_header = False
        recipient = _RECIPIENT.search(rest)
        if recipient is None and channel.group(1) == "analysis":
            self._kind = "analysis"
            if self._began is None:
                self._began = True
            if self._keep:
                answer.append(_ANALYSIS)
            return True
        self._kind = "answer"
        self._closed = True
        if self._began is None:
            self._began = False
        if recipient is not None:
            name = recipient.group(1)
            answer.append(
                HARMONY_CALL + name.removeprefix("functions.") + HARMONY_ARGS if name.startswith("functions.")
                else header + HARMONY_MESSAGE
            )
        return True


def _may_be_header(text: str) -> bool:
    """Whether `text` may still become a message's header (its `<|message|>` not out yet)."""
    rest = _after_start(text)
    if len(text) > _HEADER_MAX or "\n" in rest:
        return False
    if HARMONY_START.startswith(rest) and text == rest:
        return True
    return any(rest.startswith(lead) or lead.startswith(rest) for lead in _LEADS)


def _after_start(header: str) -> str:
    """`header` after its `<|start|>assistant` and the whitespace there (a grammar lets the
    model write some after the reasoning's closing tag), or before the recipient (` to=`)."""
    return header.removeprefix(HARMONY_START).lstrip(" \t\r\n")


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
    A lazy tool frame (tool_choice auto) has its own trigger, which llama-server's grammar
    does not see inside the reasoning: the engine gets the tags, and whether the prompt opened
    the reasoning."""
    if not tags[0] or not (params.json_schema or params.grammar or params.tool_calls):
        return
    if opened_by(prompt, tags) is not None:
        params.grammar_after = tags[1]
        if params.tool_calls is not None and params.tool_calls.lazy:
            params.grammar_reasoning = tags  # the opening tag too: a later reasoning block
    elif not _closed_empty(prompt, tags):
        params.grammar_reasoning = tags


# The largest reasoning budget: the engine counts it in a C int, as llama-server's.
MAX_BUDGET = 2**31 - 1


def budget(params: GenerateParams, tokens: int | None, message: str | None, tags: tuple[str, str], opened: bool) -> None:
    """llama-server's reasoning budget (`reasoning_budget_tokens`, -1: none): at most `tokens`
    tokens inside the reasoning, then `message` (if any) and the closing tag are written in
    its place. A budget for a template without reasoning, or a message without a budget,
    would change nothing: a 400 naming the field."""
    if tokens is None or tokens == -1:
        if message is not None:
            raise InvalidArgument("reasoning_budget_message: only with reasoning_budget_tokens")
        return
    if not -1 <= tokens <= MAX_BUDGET:
        raise InvalidArgument(f"reasoning_budget_tokens must be -1 (none) or between 0 and {MAX_BUDGET}, got {tokens}")
    if not tags[0]:
        raise InvalidArgument("reasoning_budget_tokens: the model's chat template has no reasoning")
    if message and tags[1] in message:
        # The message goes before the closing tag: one inside it would close the reasoning early.
        raise InvalidArgument(f"reasoning_budget_message: must not hold the closing tag {tags[1]!r}")
    params.reasoning_budget = tokens
    params.reasoning_end = (message or "") + tags[1]
    params.reasoning_tags = tags
    params.reasoning_opened = opened


def _closed_empty(prompt: str, tags: tuple[str, str]) -> bool:
    """Whether `prompt` ends with an empty reasoning its template opened and closed (Qwen 3's
    `<think>\\n\\n</think>`: thinking turned off). gpt-oss's prompts end with `<|end|>` and
    `<|start|>assistant` after every user message, its closing tag, with no reasoning before."""
    body = prompt.rstrip()
    return body.endswith(tags[1]) and body[: len(body) - len(tags[1])].rstrip().endswith(tags[0])


def effort_prompt(render: Callable[[dict[str, Any]], str], variables: Mapping[str, Any] | None, effort: str) -> str | None:
    """The prompt `render` (the chat template, given its variables) writes with `effort` as
    its `reasoning_effort` (the name gpt-oss's template reads a reasoning level by), or None
    where the template does not read it: its prompt for "low" and for "high" is the same, and
    a level without effect is not taken."""
    prompts = {level: render({**(variables or {}), "reasoning_effort": level}) for level in ("low", "high")}
    if prompts["low"] == prompts["high"]:
        return None
    return prompts.get(effort) or render({**(variables or {}), "reasoning_effort": effort})


def overlap(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag` (shorter than it): what
    a stream holds back until it knows whether the tag is coming."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
