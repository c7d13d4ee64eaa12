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

Tools (llama-server's `--jinja` again): `tools` is the template's `tools` variable; assistant
messages may carry OpenAI `tool_calls` and `tool` messages their results. Messages and tools
are rebuilt in llama-server's shape first (see `_messages`, `_tools`), and a template that
reads a call's arguments as an object gets them parsed from their JSON text (llama.cpp probes
each template for that at load). `ChatTemplate.tool_syntax` names the syntax the template
writes calls in, from its text, as llama.cpp matched templates before its automatic parser.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
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


# What the probe for object tool-call arguments sends as an argument's value.
_ARGUMENT_PROBE = "edged-argument-probe"
# The probe's call as Qwen 3.5 / Qwen3-Coder templates write it (llama.cpp's "Qwen3-Coder"
# format; templates that leave out the newlines between the tags are another format).
_XML_PROBE = f"<tool_call>\n<function=tool1>\n<parameter=arg>\n{_ARGUMENT_PROBE}\n</parameter>\n</function>\n</tool_call>"
# As MiniCPM5's template writes it (llama.cpp's "MiniCPM5" format).
_MINICPM5_PROBE = f'<function name="tool1"><param name="arg">{_ARGUMENT_PROBE}</param></function>'
# As Gemma 4's template writes it.
_GEMMA_PROBE = f'<|tool_call>call:tool1{{arg:<|"|>{_ARGUMENT_PROBE}<|"|>}}<tool_call|>'
# As gpt-oss's template writes it (its "harmony" format: the recipient in the message's header).
_HARMONY_PROBE = "to=functions.tool1<|channel|>commentary json<|message|>"
# DeepSeek R1's calls section and how its templates write the probe's call in it (the fullwidth
# bar and the "lower one eighth block" are R1's own characters): the tool's type and name, then
# its arguments object in a JSON code block.
_R1_CALLS = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
_R1_PROBE = "<\uff5ctool\u2581call\u2581begin\uff5c>function<\uff5ctool\u2581sep\uff5c>tool1\n```json\n"
# Markers of the tool-call syntaxes edged reads, as llama.cpp's common/chat.cpp matched
# templates before its automatic parser (Hermes 2 Pro first, then Llama 3.x, Mistral Nemo).
_TOOL_SYNTAXES = (
    ("<tool_call>", "hermes"),
    ("<|start_header_id|>ipython<|end_header_id|>", "llama3"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|tool_call>call:", "gemma4"),
    ("<|start|>assistant to=", "gpt_oss"),
    # LFM2 lists the tools between its own tokens, LFM2.5 after "List of tools: [" (llama.cpp's
    # matching); either may leave calls out of the history, so no probe decides.
    ("<|tool_list_start|>", "lfm2"),
    ("List of tools: [", "lfm2"),
    # Nemotron Nano v2 (llama.cpp patches its automatic parser for this template: one JSON list
    # per `<TOOLCALL>` section); the probe checks the template writes calls so.
    ("<TOOLCALL>", "nemotron_v2"),
    # DeepSeek R1 (llama.cpp's own R1 template) and its Qwen distill (llama.cpp patches its
    # automatic parser for it); DeepSeek V3.1 and later share the marker but write calls
    # another way, which the probe tells apart (_R1_PROBE).
    (_R1_CALLS, "deepseek_r1"),
    # MiniCPM5: llama.cpp also looks for `<function name="` and `<param name="`, which the probe
    # call checks.
    ("Tool usage guidelines:", "minicpm5"),
    # Apertus: one JSON list of `{"NAME": {...}}` objects (llama.cpp's automatic parser finds
    # this layout from the template's renderings); the probe checks the template writes calls so.
    ("<|tools_prefix|>", "apertus"),
)
# Syntaxes whose calls are one JSON list after their marker (`_writes_calls_in`).
_LIST_MARKERS = {"mistral": "[TOOL_CALLS]", "nemotron_v2": "<TOOLCALL>", "apertus": "<|tools_prefix|>"}
# gpt-oss's reasoning (thinking_tags): its analysis channel, up to where the next message
# begins, as a grammar that lets the model reason first must write it.
HARMONY_TAGS = ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant")

# The reasoning tags edged splits a reply on (GenerationBackend.thinking_tags): those of Qwen 3,
# QwQ, DeepSeek R1 and its distills, GLM 4.5+, SmolLM 3, MiniMax M2, Nemotron Nano and most open
# reasoning models; Magistral's and Ministral 3's; Gemma 4's thought channel. Others (gpt-oss
# channels, Command R7B's) are not split.
_THINKING_TAGS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"), ("<|channel>thought", "<channel|>"))

Render = Callable[[Messages, Mapping[str, Any], "Sequence[Mapping[str, Any]] | None"], str]


def thinking_tags_of(template: str) -> tuple[str, str]:
    """The reasoning tags a Jinja template writes or reads (both tags in its text: it renders
    past reasoning, strips it from history, or opens it in the generation prompt)."""
    return next((tags for tags in _THINKING_TAGS if all(tag in template for tag in tags)), ("", ""))


def tool_syntax_of(template: str) -> str:
    """The tool-call syntax a Jinja template's text names (GenerationBackend.tool_syntax);
    `_writes_calls_in` then checks that the template really writes calls that way."""
    return next((syntax for marker, syntax in _TOOL_SYNTAXES if marker in template), "")


def _writes_calls_in(syntax: str, rendered: str) -> bool:
    """Whether `rendered` (the probe conversation of `_probe_call`) holds the probe's call in
    `syntax`: other formats share the markers (Qwen3-Coder's and MiniMax's XML calls inside
    `<tool_call>`, newer Mistral templates' `[TOOL_CALLS]name[ARGS]{...}`), and a model asked
    for a syntax it was not trained on writes worse calls than the generic reply gets."""
    decoder = json.JSONDecoder()
    arguments_key = "parameters" if syntax == "llama3" else "arguments"
    marker = {"hermes": "<tool_call>", **_LIST_MARKERS}.get(syntax, "")
    at = rendered.find(marker) if marker else 0
    while at >= 0:
        start = at + len(marker)
        while start < len(rendered) and rendered[start] in " \t\r\n":
            start += 1
        try:
            value, _ = decoder.raw_decode(rendered, start)
        except ValueError:
            value = None
        calls = value if syntax in _LIST_MARKERS and isinstance(value, list) else [value]
        for call in calls:
            if syntax == "apertus" and isinstance(call, dict) and list(call) == ["tool1"]:
                # The tool's name is the call object's only key.
                call = {"name": "tool1", arguments_key: call["tool1"]}
            if isinstance(call, dict) and call.get("name") == "tool1":
                arguments = call.get(arguments_key)
                if isinstance(arguments, str):
                    with contextlib.suppress(ValueError):
                        arguments = json.loads(arguments)
                if arguments == {"arg": _ARGUMENT_PROBE}:
                    return True
        # Llama 3.x calls have no marker: try each object in the text.
        at = rendered.find(marker or "{", at + 1)
    return False


def _writes_r1_calls(rendered: str) -> bool:
    """Whether `rendered` (the probe conversation) holds the probe's call as DeepSeek R1's
    templates write it: `_R1_PROBE`, then its arguments object. The Llama distill's template
    writes calls only for a `content` of None, which llama-server (and edged) make "": none."""
    at = rendered.find(_R1_PROBE)
    if at < 0:
        return False
    try:
        value, _ = json.JSONDecoder().raw_decode(rendered, at + len(_R1_PROBE))
    except ValueError:
        return False
    return value == {"arg": _ARGUMENT_PROBE}


def _named_mistral(rendered: str) -> str:
    """The syntax "mistral_call_id" or "mistral_args" where `rendered` (the probe conversation)
    holds the probe's call as newer Mistral templates write it, name then arguments, with
    (Mistral Small 3.2) or without (Ministral 3, Devstral) `[CALL_ID]` and the call's id
    between; else ""."""
    forms = (("mistral_call_id", "[TOOL_CALLS]tool1[CALL_ID]call00001[ARGS]"), ("mistral_args", "[TOOL_CALLS]tool1[ARGS]"))
    for syntax, head in forms:
        at = rendered.find(head)
        if at < 0:
            continue
        try:
            value, _ = json.JSONDecoder().raw_decode(rendered, at + len(head))
        except ValueError:
            continue
        if value == {"arg": _ARGUMENT_PROBE}:
            return syntax
    return ""


class ChatTemplate:
    """Renders OpenAI-style messages (role, content, optional name; tool calls and results for
    Jinja templates) to a prompt string."""

    def __init__(
        self, source: str, render: Render, *, jinja: bool, tool_syntax: str = "",
        thinking: tuple[str, str] = ("", ""),
    ) -> None:
        self.source = source
        self.jinja = jinja
        # "hermes" | "llama3" | "mistral" | "mistral_args" | "mistral_call_id" | "qwen3_coder" |
        # "gemma4" | "gpt_oss" | "lfm2" | "nemotron_v2" | "deepseek_r1" | "minicpm5" | "apertus" | "": see
        # tool_syntax_of, _named_mistral, _XML_PROBE, _GEMMA_PROBE, _HARMONY_PROBE, _R1_PROBE and
        # _MINICPM5_PROBE (Jinja templates only).
        self.tool_syntax = tool_syntax
        # The reasoning tags (thinking_tags_of; Jinja templates only).
        self.thinking = thinking
        self._render = render

    def render(
        self,
        messages: Messages,
        variables: Mapping[str, Any] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """`variables`: more names for a Jinja template (`chat_template_kwargs`); `tools`:
        OpenAI function tools for a Jinja template (its `tools` variable)."""
        variables = variables or {}
        if not self.jinja:
            # llama.cpp's built-in formats and ChatML have no place for a participant's name,
            # tools or tool calls.
            for index, message in enumerate(messages):
                if message.get("name"):
                    raise InvalidArgument(
                        f"messages[{index}].name: the model's chat template ({self.source}) cannot "
                        "represent participant names"
                    )
                if message.get("tool_calls"):
                    raise InvalidArgument(
                        f"messages[{index}].tool_calls: the model's chat template ({self.source}) cannot "
                        "represent tool calls"
                    )
            if variables:
                raise InvalidArgument(
                    f"chat_template_kwargs: the model's chat template ({self.source}) is not Jinja "
                    "and takes no variables"
                )
            if tools:
                raise InvalidArgument(f"tools: the model's chat template ({self.source}) is not Jinja and takes no tools")
        reserved = sorted(RESERVED_VARIABLES & set(variables))
        if reserved:
            raise InvalidArgument(f"chat_template_kwargs: {reserved[0]!r} is set by the server, not the request")
        return self._render(messages, variables, tools)


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
    return ChatTemplate("chatml (fallback)", lambda messages, _, __: chatml(messages), jinja=False)


def _looks_like_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def _jinja(template: str, source: str, *, bos: str, eos: str, strip_bos: bool) -> ChatTemplate:
    compiled = _environment().from_string(template)
    thinking = thinking_tags_of(template)

    def run(messages: Messages, variables: Mapping[str, Any], tools: Sequence[Mapping[str, Any]] | None) -> str:
        today = datetime.datetime.now()
        # llama-server's extra context; the request's variables may replace it. It sets
        # `enable_thinking` for every template, true where the template reasons (DeepSeek R1's
        # closes the reasoning unless it is true; Qwen 3's only when it is false).
        context = {"date_string": today.strftime("%d %b %Y"), "datetime": today.strftime("%b %d %Y"),
                   "enable_thinking": bool(thinking[0])}
        # No tools: `tools` stays undefined, as llama-server leaves it.
        given = {"tools": tools} if tools else {}
        return compiled.render(
            **{**context, **variables},
            **given,
            messages=messages,
            bos_token=bos,
            eos_token=eos,
            add_generation_prompt=True,
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
        )

    system_role = _takes_system_role(run)
    object_arguments = _takes_object_arguments(run)
    harmony = False  # set below, once the probe has shown the template is gpt-oss's
    minicpm5 = False  # likewise for MiniCPM5's

    def render(messages: Messages, variables: Mapping[str, Any], tools: Sequence[Mapping[str, Any]] | None) -> str:
        # Rebuilt as llama-server passes them to the template (checked, naming the bad field).
        normalized: Messages = _messages(messages, object_arguments=object_arguments)
        if not system_role:
            normalized = _system_into_next(normalized)
        if harmony:
            normalized = _harmony_messages(normalized)
        if minicpm5:
            normalized = _minicpm5_messages(normalized)
        try:
            prompt = run(normalized, variables, _tools(tools) if tools else None)
        except Exception as exc:
            # The template's own code failed on these messages: raise_exception() ("roles
            # must alternate"), an undefined field, a type error. The request is what it
            # cannot render, so a 400 naming the template's complaint, not a server error.
            raise InvalidArgument(f"messages: the model's chat template refused them: {exc}") from None
        if strip_bos and bos and prompt.startswith(bos):
            prompt = prompt[len(bos) :]
        return prompt

    render([{"role": "user", "content": "hi"}], {}, None)  # fails now, at load, for a broken template
    syntax = tool_syntax_of(template)
    if syntax:
        messages, tools = _probe_call()
        try:
            rendered = render(messages, {}, tools)
        except InvalidArgument:
            rendered = ""
        if syntax == "gemma4":
            written = _GEMMA_PROBE in rendered
        elif syntax == "gpt_oss":
            written = _HARMONY_PROBE in rendered and _ARGUMENT_PROBE in rendered
        elif syntax == "lfm2":
            written = True
        elif syntax == "deepseek_r1":
            written = _writes_r1_calls(rendered)
        elif syntax == "minicpm5":
            written = _MINICPM5_PROBE in rendered
        else:
            written = _writes_calls_in(syntax, rendered)
        if not written and syntax == "mistral":
            # Newer Mistral templates write `[TOOL_CALLS]name[ARGS]{...}`, a frame of its own.
            syntax = _named_mistral(rendered)
            written = bool(syntax)
        elif not written and syntax == "hermes" and _XML_PROBE in rendered:
            # Qwen 3.5, Qwen3-Coder and Nemotron Nano 3: XML parameters inside `<tool_call>`.
            syntax, written = "qwen3_coder", True
        if not written:
            log.info("chat template (%s) names %s tool-call markers but writes calls another way; "
                     "tools use the generic JSON reply", source, syntax)
            syntax = ""
    if syntax == "gpt_oss":
        harmony, thinking = True, HARMONY_TAGS
    minicpm5 = syntax == "minicpm5"
    return ChatTemplate(source, render, jinja=True, tool_syntax=syntax, thinking=thinking)


def _minicpm5_messages(messages: Messages) -> Messages:
    """The messages for MiniCPM5's template, which prints each argument's value as it is (`{{ v
    }}`): an object, a list or null as its JSON text, the way the model writes such a value
    (llama-server's Jinja prints an object and null as nothing and runs a list's items
    together, Python's Jinja would print their repr); strings, numbers and booleans as given."""
    result = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            rebuilt = []
            for call in calls:
                arguments = call["function"]["arguments"]
                if isinstance(arguments, dict):
                    arguments = {
                        key: json.dumps(value, ensure_ascii=False) if value is None or isinstance(value, (dict, list))
                        else value
                        for key, value in arguments.items()
                    }
                rebuilt.append({**call, "function": {**call["function"], "arguments": arguments}})
            message = {**message, "tool_calls": rebuilt}
        result.append(message)
    return result


def _harmony_messages(messages: Messages) -> Messages:
    """The messages as llama-server hands them to gpt-oss's template: an assistant's
    `reasoning_content` as its `thinking` (the template's name for it), and no `content`
    beside it in a message with tool calls (the template refuses both). The template renders
    one call per assistant message (its first): more is a 400, not a call left out."""
    result = []
    for index, message in enumerate(messages):
        calls = message.get("tool_calls") or []
        if len(calls) > 1:
            raise InvalidArgument(
                f"messages[{index}].tool_calls: the model's chat template (gpt-oss) takes one call per "
                "assistant message; send each call in its own assistant message"
            )
        if message.get("reasoning_content"):
            rebuilt = {**message, "thinking": message["reasoning_content"]}
            if calls:
                del rebuilt["content"]
            message = rebuilt
        result.append(message)
    return result


def _messages(messages: Messages, *, object_arguments: bool) -> list[dict[str, Any]]:
    """The messages as llama-server hands them to a template (common_chat_msg's OpenAI JSON):
    role, content ("" for an assistant's tool calls without text), then reasoning_content,
    name and tool_call_id where not empty, then tool_calls as {type, function: {name,
    arguments}, id}. `object_arguments`: the template reads arguments as an object (parsed
    from their JSON text) rather than as the text itself."""
    result = []
    for index, message in enumerate(messages):
        role, content, calls = message.get("role"), message.get("content"), message.get("tool_calls")
        if not isinstance(role, str) or not role:
            raise InvalidArgument(f"messages[{index}]: 'role' must be a non-empty string")
        if calls is not None and not isinstance(calls, list):
            raise InvalidArgument(f"messages[{index}].tool_calls: must be a list")
        if content is None and calls is not None:
            content = ""
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{index}]: 'content' must be a string")
        rebuilt: dict[str, Any] = {"role": role, "content": content}
        for key in ("reasoning_content", "name", "tool_call_id"):
            value = message.get(key)
            if value is not None and not isinstance(value, str):
                raise InvalidArgument(f"messages[{index}].{key}: must be a string")
            if value:
                rebuilt[key] = value
        if calls:
            rebuilt["tool_calls"] = [
                _tool_call(call, f"messages[{index}].tool_calls[{number}]", object_arguments)
                for number, call in enumerate(calls)
            ]
        result.append(rebuilt)
    return result


def _tool_call(call: Any, where: str, object_arguments: bool) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise InvalidArgument(f"{where}: must be an object")
    if call.get("type", "function") != "function":
        raise InvalidArgument(f"{where}.type: only 'function' tool calls are supported")
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidArgument(f"{where}.function: must be an object with a string 'name'")
    arguments = function.get("arguments")
    if arguments is None:
        raise InvalidArgument(f"{where}.function.arguments: missing")
    if isinstance(arguments, str):
        if object_arguments:
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                raise InvalidArgument(f"{where}.function.arguments: not valid JSON: {exc}") from None
    elif not object_arguments:
        # JSON given as a value: its text, compact as llama-server writes it.
        arguments = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    rebuilt: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    ident = call.get("id")
    if ident is not None and not isinstance(ident, str):
        raise InvalidArgument(f"{where}.id: must be a string")
    if ident:
        rebuilt["id"] = ident
    return rebuilt


def _tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI function tools as llama-server hands them to a template: {type, function: {name,
    description ("" when absent), parameters ({} when absent)}}, other fields dropped."""
    result = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping):
            raise InvalidArgument(f"tools[{index}]: only tools of type 'function' with a 'function' object are supported")
        name, description = function.get("name"), function.get("description") or ""
        if not isinstance(name, str) or not isinstance(description, str):
            raise InvalidArgument(f"tools[{index}].function: 'name' and 'description' must be strings")
        parameters = function.get("parameters", {})
        result.append({
            "type": "function",
            "function": {"name": name, "description": description, "parameters": parameters},
        })
    return result


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
    environment.filters["tojson"] = _tojson
    return environment


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:
    """Jinja2ChatFormatter's `tojson`, but a filter's lazy result (`map`, `select`, `reject`:
    llama.cpp's `llama-cpp-deepseek-r1.jinja` writes `tools | map(attribute='function') |
    tojson(indent=2)`) is written as the list it yields, as llama-server's Jinja writes it;
    json.dumps alone refuses a generator."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
        default=_lazy_sequence,
    )


def _lazy_sequence(value: Any) -> list[Any]:
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _takes_system_role(run: Render) -> bool:
    """Whether the template shows a system message's text (Gemma's refuses one)."""
    try:
        probe = [{"role": "system", "content": _SYSTEM_PROBE}, {"role": "user", "content": "hi"}]
        return _SYSTEM_PROBE in run(probe, {}, None)
    except Exception:
        return False


def _probe_call(arguments: Any = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A conversation with one tool call and its result, and the tool (llama.cpp's probe);
    `arguments`: the call's arguments as given (default: their JSON text, as requests give)."""
    value = json.dumps({"arg": _ARGUMENT_PROBE}) if arguments is None else arguments
    call = {"id": "call00001", "type": "function", "function": {"name": "tool1", "arguments": value}}
    probe: list[dict[str, Any]] = [
        {"role": "user", "content": "User message"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        {"role": "user", "content": "User message"},
    ]
    parameters = {
        "type": "object",
        "properties": {"arg": {"type": "string", "description": "Arg description"}},
        "required": ["arg"],
    }
    tools = [{"type": "function", "function": {"name": "tool1", "description": "Tool description", "parameters": parameters}}]
    return probe, tools


def _takes_object_arguments(run: Render) -> bool:
    """Whether the template reads a tool call's arguments as an object (Qwen 2.5 and Llama 3.1
    write `arguments | tojson`), llama.cpp's capability probe: a call whose arguments are an
    object is rendered, and the object counts as read when its value comes out, other than
    inside Python's repr of the whole dict (a template that prints the arguments as text)."""
    probe, tools = _probe_call({"arg": _ARGUMENT_PROBE})
    try:
        rendered = run(probe, {}, tools)
    except Exception:
        return False
    # Python's repr of the dict, not a value in quotes (LFM2.5 writes `tool1(arg='...')`).
    return _ARGUMENT_PROBE in rendered and f"'arg': '{_ARGUMENT_PROBE}'" not in rendered


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
    def render(messages: Messages, variables: Mapping[str, Any], tools: Sequence[Mapping[str, Any]] | None) -> str:
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
