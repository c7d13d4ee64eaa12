"""JSON Schema -> GBNF for structured output, refusing what the conversion would not enforce.

llama-cpp-python's `json_schema_to_gbnf` (a port of llama.cpp's json-schema-to-grammar)
turns a schema into a grammar that llama.cpp's grammar sampler enforces token by token. It
silently skips keywords it does not implement (`minimum`, `uniqueItems`, `not`, ...), so a
schema is checked first against the keywords it does honour: anything else is a 400 naming
the keyword and where it is, never a constraint that quietly does not hold.
"""

from __future__ import annotations

import json
import re
from typing import Any

from daemon.backend import InvalidArgument, ToolCallFrame

# Keywords the converter enforces, plus annotations that constrain nothing.
_ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "pattern",
    "format", "minLength", "maxLength",
})
_ANNOTATIONS = frozenset({
    "$schema", "$id", "$defs", "definitions", "title", "description", "default", "examples",
    "$comment", "deprecated", "readOnly", "writeOnly",
})
# String formats the converter has rules for.
_FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})
_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})

# Any JSON object: OpenAI's response_format {"type": "json_object"}.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def schema_to_grammar(schema_json: str, where: str) -> str:
    """GBNF for a JSON schema (JSON text); InvalidArgument naming `where` for what we cannot enforce."""
    return _convert(schema_json, where, "")[1]


def _convert(schema_json: str, where: str, rule: str) -> tuple[str, str]:
    """The schema's rule name and the GBNF rules, by llama-cpp-python's port of llama.cpp's
    converter (`json_schema_to_gbnf`'s steps): rule "" is "root"; another name leaves
    "root" to the caller's own top rule. The schema is checked first (`_check`)."""
    names, rules = _convert_all([(schema_json, rule)], where)
    return names[0], rules


def _convert_all(schemas: list[tuple[str, str]], where: str) -> tuple[list[str], str]:
    """`_convert` for several (schema, rule) pairs into one set of rules: one converter, so
    the rules they share (strings, whitespace) are written once and their names never clash."""
    from llama_cpp.llama_grammar import SchemaConverter

    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    names = []
    for schema_json, rule in schemas:
        try:
            schema = json.loads(schema_json)
        except ValueError as exc:
            raise InvalidArgument(f"{where}: not valid JSON: {exc}") from None
        _check(schema, where)
        try:
            names.append(converter.visit(converter.resolve_refs(schema, "stdin"), rule))
        except (ValueError, AssertionError, KeyError, TypeError, RecursionError) as exc:
            raise InvalidArgument(f"{where}: cannot be turned into a grammar: {exc}") from None
    return names, converter.format_grammar()


def tool_call_grammar(frame: ToolCallFrame) -> str:
    """GBNF (root rule "root") for `frame`: open, 1..max_calls calls each matching its
    `call_schema`, separated by `separator`, then close; schema problems name "tools"."""
    if frame.max_calls is not None and frame.max_calls < 1:
        raise InvalidArgument(f"tool_calls.max_calls must be >= 1, got {frame.max_calls}")
    if frame.named_calls:
        call, rules = _named_calls(frame)
    else:
        # The call's rule is "tool-call": "root" is the frame's own rule below, the one
        # llama.cpp starts from.
        call, rules = _convert(frame.call_schema, "tools", "tool-call")
    more = f"{gbnf_literal(frame.separator)} {call}".strip()
    if frame.max_calls is None:
        calls = f"{call} ({more})*"
    elif frame.max_calls == 1:
        calls = call
    else:
        calls = f"{call} ({more}){{0,{frame.max_calls - 1}}}"
    root = " ".join(part for part in (gbnf_literal(frame.open), calls, gbnf_literal(frame.close)) if part)
    return f"root ::= {root}\n{rules}\n"


def _named_calls(frame: ToolCallFrame) -> tuple[str, str]:
    """The call rule of a frame of named calls: one alternative per tool, its name, the id
    part where the frame has one, `args_marker`, then its arguments."""
    tools = list(frame.named_calls.items())
    names, rules = _convert_all([(schema, f"tool-args-{i}") for i, (_, schema) in enumerate(tools)], "tools")
    ident = f"{gbnf_literal(frame.id_marker)} [a-zA-Z0-9]{{9}} " if frame.id_marker else ""
    marker = gbnf_literal(frame.args_marker)
    alternatives = " | ".join(
        f"{gbnf_literal(name)} {ident}{marker} {rule}" for (name, _), rule in zip(tools, names, strict=True)
    )
    return "tool-call", f"tool-call ::= {alternatives}\n{rules}"


def tool_call_trigger(frame: ToolCallFrame, *, brace: bool, brace_quote: bool) -> str:
    r"""The ECMAScript pattern that starts a lazy `frame`'s grammar (llama.cpp's lazy grammar
    replays the output from the pattern's first capture group into the grammar).

    llama.cpp aborts the process when a replayed piece does not fit the grammar, and a token
    can run past the end of `open`: so the pattern holds only where the output *ends* with
    `open`, or with `open` and a start of a call the caller found the grammar accepts
    (`brace`: "{", `brace_quote`: '{"', tokens such as Llama 3's `{"`). With an empty `open`,
    the output's first character other than whitespace must be "{" (anchored at the start:
    no pattern here scans the whole output with `[\s\S]*`, whose recursion in std::regex
    grows with the text)."""
    brace_tails = ([r'\{"'] if brace_quote else []) + ([r"\{"] if brace else [])
    if not frame.open:
        # The caller refuses an empty `open` whose calls cannot start with "{".
        return rf"^\s*({'|'.join(brace_tails)})$"
    # The marker itself is enough (llama-server triggers on it too): `[TOOL_CALLS]` before the
    # "[" of "[TOOL_CALLS][", `<tool_call>` before its newline; the grammar then writes the
    # rest of `open`. So the output may end with the marker and any start of what follows it.
    core = frame.open.rstrip(" \t\r\n[{") or frame.open
    rest = f"(?:{'|'.join(brace_tails)})?" if brace_tails else ""
    for char in reversed(frame.open[len(core) :]):
        rest = f"(?:{regex_escape(char)}{rest})?"
    return f"({regex_escape(core)}{rest})$"


def gbnf_literal(text: str) -> str:
    """`text` as a GBNF string literal ("" for empty text: nothing to write)."""
    if not text:
        return ""
    escaped = "".join(_GBNF_ESCAPES.get(c, f"\\x{ord(c):02X}" if ord(c) < 0x20 else c) for c in text)
    return f'"{escaped}"'


_GBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

# ECMAScript's syntax characters (std::regex's default grammar): llama.cpp's regex_escape set.
_REGEX_SYNTAX = re.compile(r"[.^$|()*+?\[\]{}\\]")


def regex_escape(text: str) -> str:
    return _REGEX_SYNTAX.sub(lambda m: "\\" + m.group(), text)


def _check(schema: Any, where: str) -> None:
    if isinstance(schema, bool):
        if schema is False:
            raise InvalidArgument(f"{where}: the schema `false` matches nothing")
        return
    if not isinstance(schema, dict):
        raise InvalidArgument(f"{where}: a schema must be an object")
    for key in schema:
        if key not in _ENFORCED and key not in _ANNOTATIONS:
            raise InvalidArgument(f"{where}: keyword '{key}' is not supported for structured output")
    kinds = schema.get("type")
    for kind in kinds if isinstance(kinds, list) else [kinds] if kinds is not None else []:
        if kind not in _TYPES:
            raise InvalidArgument(f"{where}.type: unknown type {kind!r}")
    if "format" in schema:
        if schema["format"] not in _FORMATS:
            raise InvalidArgument(f"{where}.format: '{schema['format']}' is not supported for structured output")
        if {"pattern", "minLength", "maxLength"} & schema.keys():
            raise InvalidArgument(f"{where}: 'format' cannot be combined with pattern/minLength/maxLength")
    if "pattern" in schema and {"minLength", "maxLength"} & schema.keys():
        raise InvalidArgument(f"{where}: 'pattern' cannot be combined with minLength/maxLength")
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise InvalidArgument(f"{where}.$ref: only local references ('#/...') are supported")
    if "allOf" in schema and kinds not in (None, "object"):
        raise InvalidArgument(f"{where}.allOf: only supported for objects")
    for key in ("properties", "$defs", "definitions"):
        children = schema.get(key, {})
        if not isinstance(children, dict):
            raise InvalidArgument(f"{where}.{key}: must be an object")
        for name, child in children.items():
            _check(child, f"{where}.{key}.{name}")
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for index, child in enumerate(schema.get(key, [])):
            _check(child, f"{where}.{key}[{index}]")
    items = schema.get("items")
    if isinstance(items, list):
        for index, child in enumerate(items):
            _check(child, f"{where}.items[{index}]")
    elif items is not None:
        _check(items, f"{where}.items")
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        _check(extra, f"{where}.additionalProperties")
