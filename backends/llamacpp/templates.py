"""Chat templates: the GGUF's Jinja template first, llama.cpp's built-in matcher as the fallback.

Which template renders a model's chat prompts, in order:

1. `chat_template` in the model's config: Jinja text (it contains `{{` or `{%`) is compiled
   and must render; anything else must be a llama.cpp built-in name such as "chatml".
2. The GGUF's `tokenizer.chat_template`, run as Jinja (llama-cpp-python's
   `Jinja2ChatFormatter`: a sandboxed environment with the helpers Hugging Face templates
   expect — `raise_exception`, `strftime_now`, `tojson`).
3. When that template does not compile or render, llama.cpp's built-in matcher, which
   recognises well-known formats by their markers.
4. ChatML.

`ChatTemplate.source` says which one was used; the engine reports it in its stats.

BOS: Jinja templates usually start with `{{ bos_token }}` while llama.cpp's tokenizer adds
BOS itself for models whose vocabulary asks for it; one leading BOS is then cut from the
rendered text so the prompt does not start with two (llama-server does the same).

Rendering follows llama-server's `--jinja` (its `/apply-template` renders the same text):
variables a request does not give are left undefined, not None (a Hermes-style template loops
over `tools` unconditionally); `date_string` and `datetime` are today's date (Llama 3.1 prints
`date_string`); a template that ignores or refuses a system message gets it prepended to the
next message instead (Gemma 2 raises "System role not supported").
"""

from __future__ import annotations

import ctypes
import datetime
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import llama_cpp.llama_cpp as llama

from daemon.backend import BackendError, ConfigError, InvalidArgument, Unsupported

from .text import chatml, message_pairs

log = logging.getLogger(__name__)

Messages = Sequence[Mapping[str, Any]]


# What the Jinja renderer sets itself: a request's template variables cannot replace them.
RESERVED_VARIABLES = frozenset({
    "messages", "eos_token", "bos_token", "raise_exception", "add_generation_prompt",
    "functions", "function_call", "tools", "tool_choice", "strftime_now",
})
# What the probe for system-message support sends (llama.cpp's capability check works alike).
_SYSTEM_PROBE = "edged-system-probe"


class ChatTemplate:
    """Renders OpenAI-style messages (role, content, optional name) to a prompt string."""

    def __init__(self, source: str, render: Callable[[Messages, Mapping[str, Any]], str], *, jinja: bool) -> None:
        self.source = source
        self.jinja = jinja
        self._render = render

    def render(self, messages: Messages, variables: Mapping[str, Any] | None = None) -> str:
        """`variables`: more names for a Jinja template (`chat_template_kwargs`)."""
        variables = variables or {}
        if not self.jinja:
            # llama.cpp's built-in formats and ChatML have no place for a participant's name.
            named = next((i for i, m in enumerate(messages) if m.get("name")), None)
            if named is not None:
                raise InvalidArgument(
                    f"messages[{named}].name: the model's chat template ({self.source}) cannot "
                    "represent participant names"
                )
            if variables:
                raise InvalidArgument(
                    f"chat_template_kwargs: the model's chat template ({self.source}) is not Jinja "
                    "and takes no variables"
                )
        reserved = sorted(RESERVED_VARIABLES & set(variables))
        if reserved:
            raise InvalidArgument(f"chat_template_kwargs: {reserved[0]!r} is set by the server, not the request")
        return self._render(messages, variables)


def resolve(
    model: str, configured: str, gguf_template: str | None, *, bos: str, eos: str, strip_bos: bool
) -> ChatTemplate:
    """Pick the template as the module docstring describes; ConfigError for a bad override."""
    if configured:
        if _looks_like_jinja(configured):
            try:
                return _jinja(configured, "config (jinja)", bos=bos, eos=eos, strip_bos=strip_bos)
            except Exception as exc:
                raise ConfigError(f"model '{model}': chat_template does not render as Jinja: {exc}") from None
        try:
            apply_chat_template(configured, [("user", "hi")])
        except Unsupported:
            raise ConfigError(
                f"model '{model}': chat_template {configured[:60]!r} is neither Jinja nor a template "
                "llama.cpp knows (a built-in name such as 'chatml', 'llama3', 'zephyr')"
            ) from None
        return _builtin(configured, f"config (llama.cpp built-in '{configured[:40]}')")
    if gguf_template:
        try:
            return _jinja(gguf_template, "gguf (jinja)", bos=bos, eos=eos, strip_bos=strip_bos)
        except Exception as exc:
            log.warning("model '%s': its chat template does not run as Jinja (%s); trying llama.cpp's matcher", model, exc)
        try:
            apply_chat_template(gguf_template, [("user", "hi")])
            return _builtin(gguf_template, "gguf (llama.cpp built-in match)")
        except Unsupported:
            log.warning("model '%s': llama.cpp does not recognise its chat template either; using ChatML", model)
    return ChatTemplate("chatml (fallback)", lambda messages, _: chatml(messages), jinja=False)


def _looks_like_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def _jinja(template: str, source: str, *, bos: str, eos: str, strip_bos: bool) -> ChatTemplate:
    compiled = _environment().from_string(template)

    def run(messages: Messages, variables: Mapping[str, Any]) -> str:
        today = datetime.datetime.now()
        # llama-server's extra context; the request's variables may replace it.
        context = {"date_string": today.strftime("%d %b %Y"), "datetime": today.strftime("%b %d %Y")}
        return compiled.render(
            **{**context, **variables},
            messages=[dict(m) for m in messages],
            bos_token=bos,
            eos_token=eos,
            add_generation_prompt=True,
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
        )

    system_role = _takes_system_role(run)

    def render(messages: Messages, variables: Mapping[str, Any]) -> str:
        message_pairs(messages)  # role and content checked, naming the bad message
        if not system_role:
            messages = _system_into_next(messages)
        try:
            prompt = run(messages, variables)
        except Exception as exc:
            # The template's own code failed on these messages: raise_exception() ("roles
            # must alternate"), an undefined field, a type error. The request is what it
            # cannot render, so a 400 naming the template's complaint, not a server error.
            raise InvalidArgument(f"messages: the model's chat template refused them: {exc}") from None
        if strip_bos and bos and prompt.startswith(bos):
            prompt = prompt[len(bos) :]
        return prompt

    render([{"role": "user", "content": "hi"}], {})  # fails now, at load, for a broken template
    return ChatTemplate(source, render, jinja=True)


def _environment() -> Any:
    """The sandboxed Jinja environment Hugging Face chat templates are written for (the one
    llama-cpp-python's Jinja2ChatFormatter builds, whose helpers are reused)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    environment = ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[Jinja2ChatFormatter.IgnoreGenerationTags, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = Jinja2ChatFormatter.tojson
    return environment


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _takes_system_role(run: Callable[[Messages, Mapping[str, Any]], str]) -> bool:
    """Whether the template shows a system message's text (Gemma's refuses one)."""
    try:
        probe = [{"role": "system", "content": _SYSTEM_PROBE}, {"role": "user", "content": "hi"}]
        return _SYSTEM_PROBE in run(probe, {})
    except Exception:
        return False


def _system_into_next(messages: Messages) -> Messages:
    """A leading system message prepended to the next message, as llama-server does for a
    template without a system role; alone, a 400 (dropping it would answer another request)."""
    if not messages or messages[0]["role"] != "system":
        return messages
    if len(messages) == 1:
        raise InvalidArgument(
            "messages: the model's chat template has no system role, and the system message has no "
            "message after it to be prepended to"
        )
    merged = dict(messages[1])
    merged["content"] = f"{messages[0]['content']}\n{messages[1]['content']}"
    return [merged, *messages[2:]]


def _builtin(template: str, source: str) -> ChatTemplate:
    def render(messages: Messages, variables: Mapping[str, Any]) -> str:
        return apply_chat_template(template, message_pairs(messages))

    return ChatTemplate(source, render, jinja=False)


def apply_chat_template(template: str, messages: Sequence[tuple[str, str]]) -> str:
    """Render (role, content) pairs with one of llama.cpp's built-in templates.

    llama.cpp matches the template text (or a name such as "chatml") against the formats it
    knows; it does not run Jinja. Raises Unsupported when it recognises none. A pure string
    function: safe on any thread.
    """
    encoded = [(role.encode("utf-8"), content.encode("utf-8")) for role, content in messages]
    array = (llama.llama_chat_message * max(1, len(encoded)))()
    for i, (role, content) in enumerate(encoded):
        array[i].role = role
        array[i].content = content
    size = 2 * sum(len(r) + len(c) for r, c in encoded) + 256
    for _ in range(2):
        buffer = ctypes.create_string_buffer(size)
        needed = llama.llama_chat_apply_template(
            template.encode("utf-8"), array, len(encoded), True, buffer, size
        )
        if needed < 0:
            raise Unsupported(f"llama.cpp does not support the chat template {template[:60]!r}")
        if needed <= size:
            return buffer.raw[:needed].decode("utf-8", errors="replace")
        size = needed
    raise BackendError("llama_chat_apply_template kept growing its output")
