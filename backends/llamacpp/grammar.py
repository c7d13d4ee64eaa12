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
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import numpy as np

from daemon.backend import (
    SCHEMA_MAP_KEYWORDS,
    SCHEMA_VALUE_KEYWORDS,
    InvalidArgument,
    ToolCallFrame,
    xml_value_types,
)

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

# Bounds on what a request can make llama.cpp's grammar parser do. It recurses once per nested
# group: 20 000 of them overflowed an 8 MiB thread stack here and took the process down (a
# raw grammar, or a schema's maxLength written out as nested optional groups); and once per
# rule along a chain of rules that each begin with the next: 200 000 did (50 000 did not).
# The limits sit far below that and far above what real grammars and schemas use (the
# converter writes each repetition out: 500 strings of maxLength 1 000 are 4 MB of grammar,
# which llama.cpp parses in 0.4 s).
MAX_GRAMMAR_BYTES = 8 * 1024 * 1024
MAX_GRAMMAR_NESTING = 2048
MAX_GRAMMAR_RULES = 20_000
MAX_SCHEMA_DEPTH = 64
MAX_REPETITIONS = 1000
# The characters and classes a pattern's counted repetitions may write out (_pattern_atoms).
MAX_PATTERN_ATOMS = 100_000

# Any JSON object: OpenAI's response_format {"type": "json_object"}.
JSON_OBJECT_SCHEMA = '{"type": "object"}'

# llama-cpp-python's port of the converter is older than llama.cpp's own (llama-server's), and
# accepts other text, so the same seed wrote other JSON than llama-server, and some of it was
# not JSON at all. Its rules are laid out afresh (`_as_llama_cpp`) to accept what llama.cpp's
# accept:
# - A string's character: the port's took any byte but a quote and a backslash, so control
#   characters went out raw; a newline inside a string is not JSON (RFC 8259 7) and a strict
#   parser refuses it. Excluded as llama.cpp excludes them (with DEL; and its escapes leave out
#   "\/", which "/" writes as well).
# - Whitespace: the port's is one optional space; llama.cpp's also one or two newlines and an
#   indent, which is how models like to write JSON.
# - Where whitespace goes: the port lets it follow every value, so the answer could end in it
#   (with newlines allowed, up to 22 characters of it before the end); llama.cpp's follows
#   an opening bracket, a comma, a key and a colon, and comes before a closing bracket.
_JSON_CHAR_RULE = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4})'
_JSON_SPACE_RULE = r'| " " | "\n"{1,2} [ \t]{0,20}'


def schema_to_grammar(schema_json: str, where: str, header: str = "") -> str:
    """GBNF for a JSON schema (JSON text); InvalidArgument naming `where` for what we cannot
    enforce. `header`: text the output writes first (GenerateParams.answer_header)."""
    if not header:
        return _convert(schema_json, where, "")[1]
    rule, rules = _convert(schema_json, where, "edged-answer")
    return f"root ::= {gbnf_literal(header)} {rule}\n{rules}\n"


def _convert(schema_json: str, where: str, rule: str) -> tuple[str, str]:
    """The schema's rule name and the GBNF rules, by llama-cpp-python's port of llama.cpp's
    converter (`json_schema_to_gbnf`'s steps): rule "" is "root"; another name leaves
    "root" to the caller's own top rule. The schema is checked first (`_check`)."""
    return rule or "root", _convert_all([(schema_json, rule, where)])


def _convert_all(schemas: list[tuple[str, str, str]]) -> str:
    """The GBNF rules of several (schema, rule, where) triples, each schema's value then the
    rule of that name ("" is "root"); problems name `where`. One converter, so the rules they
    share (strings, whitespace) are written once and their names never clash; each schema
    resolves its own `$ref`s (a base of its own: two schemas' `#/$defs/X` are not one)."""
    from llama_cpp.llama_grammar import SchemaConverter

    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    aliases = []
    for number, (schema_json, rule, where) in enumerate(schemas):
        try:
            schema = json.loads(schema_json)
        except (ValueError, RecursionError) as exc:
            raise InvalidArgument(f"{where}: not valid JSON: {exc}") from None
        _check(schema, where)
        try:
            schema, targets = _own_refs(schema, f"edged-ref-{number}")
            # Every local reference now names one of `targets`, so they are handed to the
            # converter as they are. Its own resolver (`resolve_refs`) walks every object of
            # the schema and reads any `$ref` key as a reference, a property named "$ref"
            # too (its schema taken for the reference: a TypeError).
            converter._refs.update((f"#/$defs/{name}", target) for name, target in targets.items())
            name = converter.visit(schema, rule)
        except (ValueError, AssertionError, KeyError, TypeError, IndexError, RecursionError) as exc:
            raise InvalidArgument(f"{where}: cannot be turned into a grammar: {exc}") from None
        if name != (rule or "root"):
            # The converter names a value by its own rule where it has one ("integer").
            aliases.append(f"{rule or 'root'} ::= {name}")
    rules = converter._rules  # the port has no way to set its primitives
    rules.update((name, _as_llama_cpp(name, body)) for name, body in list(rules.items()))
    return "\n".join([converter.format_grammar(), *aliases])


def _as_llama_cpp(name: str, body: str) -> str:
    """A rule of the port as llama.cpp's converter writes it (see _JSON_CHAR_RULE). Every
    value's rule of the port ends with its whitespace; an object's and an array's take it
    before their closing bracket instead, the rest drop it."""
    if name == "space":
        return _JSON_SPACE_RULE
    if name == "char":
        return _JSON_CHAR_RULE
    if not body.endswith(" space"):
        return body
    body = body.removesuffix(" space").rstrip()
    for closer in ('"}"', '"]"'):
        if body.endswith(closer):
            inside = body.removesuffix(closer).rstrip()
            # An empty object's or array's rule already has its whitespace after the opening.
            return f"{inside} {closer}" if inside.endswith(" space") else f"{inside} space {closer}"
    return body


def _own_refs(schema: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """`schema` with each local `$ref` pointing at a copy of its target in the root's `$defs`
    under a name of its own (`prefix`-n), and those copies by name: the converter names a
    reference's rule by the last part of its path and reuses a rule of that name, so two
    schemas' `#/$defs/x` would otherwise share the first one's rule.

    As JSON Schema reads them, `#` and `#/...` are relative to the nearest enclosing schema
    with an `$id` (a resource of its own), else the root: a tool's parameters sit inside the
    call's schema marked so (ToolCallFrame.call_schema), and their `#/$defs/x` means their own
    `$defs`. The targets' copies sit at the root, so the converter (which walks objects only,
    no list indices) resolves every reference there."""
    if not isinstance(schema, dict):
        return ({"type": "object"} if schema is True else schema), {}  # as {} (walk)
    names: dict[int, str] = {}  # by the target object: one path may mean two targets
    copies: dict[str, Any] = {}

    def find(ref: str, bases: list[Any]) -> tuple[Any, list[Any]] | None:
        start = next((i for i in range(len(bases) - 1, 0, -1) if _is_resource(bases[i])), 0)
        node, chain = bases[start], bases[: start + 1]
        for part in _pointer(ref):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
            chain = [*chain, node]
        return node, chain[:-1]

    def local(node: Any, bases: list[Any]) -> tuple[Any, list[Any]] | None:
        """What `node`'s local `$ref` points at, and the schemas around it (None: no such ref)."""
        ref = node.get("$ref") if isinstance(node, dict) else None
        return find(ref, bases) if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) else None

    def walk(node: Any, bases: list[Any], names_map: bool = False, schema: bool = False) -> Any:
        if isinstance(node, list):
            return [walk(item, bases, schema=schema) for item in node]
        if schema and (node is True or (isinstance(node, dict) and not set(node) - _ANNOTATIONS)):
            # A schema that holds to nothing (`true`, {}, Pydantic's `Any`: a title alone): any
            # JSON value. The converter reads `true` not at all (a 500), {} as any object and
            # a title or an `$id` alone as nothing it knows (a 400, also for a tool's
            # `"parameters": {}`). A document's root (the root, a tool's parameters, the
            # generic reply's answer: an `$id`) stays what {} always was there: any object (a
            # call's arguments are one).
            whole = not bases or _is_resource(node)
            return {**(node if isinstance(node, dict) else {}), "type": "object" if whole else list(_JSON_TYPES)}
        if not isinstance(node, dict):
            return node
        if names_map:  # property or definition names: each value a schema
            return {key: walk(value, [*bases, node], schema=True) for key, value in node.items()}
        inner = [*bases, node]
        moved = {
            key: value if key in SCHEMA_VALUE_KEYWORDS
            else walk(value, inner, key in SCHEMA_MAP_KEYWORDS, key in _SUBSCHEMAS)
            for key, value in node.items()
        }
        found = local(node, inner)
        ref = node.get("$ref")
        if found is None and isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            # The converter's own lookup fails on it with a bare KeyError.
            raise ValueError(f"$ref {ref!r} points at nothing in the schema")
        if found is not None:
            ref, (target, chain) = node["$ref"], found
            if not isinstance(target, dict):
                # A path into a keyword's value ("#/$defs/x/type"): the converter would read
                # it as a schema and fail on it (AttributeError: a 500, not the client's 400).
                raise ValueError(f"$ref {ref!r} points at {json.dumps(target)[:40]}, which is not a schema")
            if id(target) not in names:
                name = names[id(target)] = f"{prefix}-{len(names)}"
                copies[name] = walk(target, chain, schema=True)  # named first: a recursive one ends
            moved["$ref"] = f"#/$defs/{names[id(target)]}"
            if "type" in node:
                # The converter writes the target alone: a `type` beside it holds only where
                # it says what the target says (OpenAPI generators write it so), else a 400.
                if node["type"] != target.get("type"):
                    raise ValueError(f"keyword 'type' beside '$ref' {ref!r} is not supported "
                                     "unless it is the target's own type")
                del moved["type"]
        every = node.get("allOf")
        if isinstance(every, list) and len(every) > 1:
            _check_merge(node, [hit[0] if (hit := local(part, inner)) else part for part in every])
        if _declared_and_more(node):
            # The converter lets any key be written with the additional properties' schema, a
            # declared one too ({"p": 5} for a string p), and its port could not write a
            # declared property before additional ones at all: the declared properties alone
            # are held to, a part of what the schema allows, all of it valid.
            moved["additionalProperties"] = False
        if isinstance(moved.get("type"), list):
            moved = _split_types(moved)
        return _one_of_all(moved)

    moved = walk(schema, [], schema=True)
    if copies:
        moved["$defs"] = {**moved.get("$defs", {}), **copies}
    _refuse_empty_cycles(copies, lambda ref: copies.get(ref.rsplit("/", 1)[-1]))
    return moved, copies


def _pointer(ref: str) -> list[str]:
    """The keys a local reference (`#` or `#/...`) walks: a URI fragment, percent-decoded,
    then a JSON pointer (RFC 6901's ~1 and ~0)."""
    if ref == "#":
        return []
    return [part.replace("~1", "/").replace("~0", "~") for part in unquote(ref[2:]).split("/")]


def _refuse_empty_cycles(targets: dict[str, Any], resolve: Callable[[str], Any]) -> None:
    """A ValueError where a reference leads back to itself before any value is written
    ({"$ref": "#"} at the root, {"anyOf": [{"$ref": "#"}, ...]}): no JSON text ends such a
    rule, and llama.cpp refuses its grammar (left recursion) with no word of which field."""

    def starts(node: Any) -> list[Any]:
        """The schemas `node` may begin with as they are: its reference, its alternatives'."""
        if not isinstance(node, dict):
            return []
        ref = node.get("$ref")
        found = [hit] if isinstance(ref, str) and (hit := resolve(ref)) is not None else []
        for key in ("anyOf", "oneOf", "allOf"):
            parts = node.get(key)
            for part in parts if isinstance(parts, list) else []:
                found += starts(part)
        return found

    done: set[int] = set()

    def visit(node: Any, path: list[int]) -> None:
        if id(node) in path:
            raise ValueError("a $ref leads back to itself before any value (a reference cycle no JSON text can end)")
        if id(node) in done:
            return
        for target in starts(node):
            visit(target, [*path, id(node)])
        done.add(id(node))

    for target in targets.values():
        visit(target, [])


# Keywords whose value is a schema or a list of schemas (one that holds to nothing among them
# is written out as any JSON value).
_SUBSCHEMAS = frozenset({"items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties"})
# Every JSON type, by the converter's names (an integer is a number).
_JSON_TYPES = ("object", "array", "string", "number", "boolean", "null")


def _declared_and_more(schema: dict[str, Any]) -> bool:
    """Whether an object schema declares properties and allows others beside them."""
    properties = schema.get("properties")
    return isinstance(properties, dict) and bool(properties) and schema.get("additionalProperties", False) is not False


def _split_types(node: dict[str, Any]) -> dict[str, Any]:
    """A schema with a list of types as an anyOf of the schema once per type, as llama.cpp's
    own converter spreads it. The port reads such a list as the types alone and drops every
    other keyword: {"type": ["object", "null"], "properties": ...} (how OpenAI's strict mode
    writes an optional object) let any object through, and an enum or maxLength beside a
    list held to nothing. Annotations and definitions stay where references find them."""
    kinds = node["type"]
    if len(kinds) == 1:
        return {**node, "type": kinds[0]}
    if "anyOf" in node or "oneOf" in node:
        raise ValueError("a list of types beside anyOf/oneOf is not supported")
    rest = {key: value for key, value in node.items() if key not in _ANNOTATIONS and key != "type"}
    kept = {key: value for key, value in node.items() if key in _ANNOTATIONS}
    return {**kept, "anyOf": [{**rest, "type": kind} for kind in kinds]}


def _one_of_all(node: dict[str, Any]) -> dict[str, Any]:
    """`node` with an `allOf` of one schema and nothing else to hold to (annotations aside)
    replaced by that schema (Pydantic v1 writes a described field so: {"description": ...,
    "allOf": [{"$ref": ...}]}). The converter reads allOf as the merge of its objects'
    properties, all required: it held an enum's value to `{}` and made optional fields
    required."""
    every = node.get("allOf")
    if not (isinstance(every, list) and len(every) == 1 and isinstance(every[0], dict)):
        return node
    if set(node) - _ANNOTATIONS - {"allOf"}:
        return node
    return {**{key: value for key, value in node.items() if key != "allOf"}, **every[0]}


# What the converter reads of an allOf of several schemas: their objects' properties merged,
# every one of them required, no others (llama_grammar's allOf branch). A node or part with
# more to hold to than that would be held to less than it says.
_MERGED = _ANNOTATIONS | {"type", "properties", "required"}


def _check_merge(node: dict[str, Any], parts: list[Any]) -> None:
    """Refuse an allOf of several schemas whose meaning the converter's merge does not keep:
    keywords beside the allOf (its properties, required, ... are dropped), a part that is no
    plain object schema (an enum, additionalProperties, anyOf: dropped, so output the schema
    forbids got through), a part requiring a property it does not list (never written)."""
    beside = sorted(set(node) - _ANNOTATIONS - {"allOf", "type"})
    if beside or node.get("type", "object") != "object":
        raise ValueError(f"allOf of several schemas beside {(beside or ['type'])[0]!r} is not supported")
    for index, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type", "object") != "object":
            raise ValueError(f"allOf[{index}]: only object schemas are supported in an allOf of several")
        extra = sorted(set(part) - _MERGED)
        if extra:
            raise ValueError(f"allOf[{index}]: keyword {extra[0]!r} is not supported in an allOf of several")
        properties = part.get("properties", {})
        missing = [name for name in part.get("required", []) if name not in properties]
        if missing:
            raise ValueError(f"allOf[{index}]: required {missing[0]!r} is not among its properties")


def _is_resource(node: Any) -> bool:
    """A schema with an `$id` of its own (not a draft-6 "#name" anchor): its refs' base."""
    ident = node.get("$id") if isinstance(node, dict) else None
    return isinstance(ident, str) and not ident.startswith("#")


def tool_call_grammar(frame: ToolCallFrame, answer: str = "", header: str = "") -> str:
    """GBNF (root rule "root") for `frame`: open, 1..max_calls calls each matching its
    `call_schema`, separated by `separator`, then close; schema problems name "tools".
    `answer` (a JSON schema, text; GenerateParams.json_schema beside a non-lazy frame): or
    instead `header` and a JSON value matching it (problems name "json_schema")."""
    if frame.max_calls is not None and frame.max_calls < 1:
        raise InvalidArgument(f"tool_calls.max_calls must be >= 1, got {frame.max_calls}")
    if answer and frame.lazy:
        raise InvalidArgument("json_schema: with tool_calls only for a frame that is not lazy")
    # The JSON schemas of the grammar, all converted at once (their rule names never clash).
    schemas: list[tuple[str, str, str]] = []
    if frame.named_calls:
        call, rules = _named_calls(frame, schemas)
    else:
        # The call's rule is "tool-call": "root" is the frame's own rule below, the one
        # llama.cpp starts from.
        call, rules = "tool-call", ""
        schemas.append((frame.call_schema, call, "tools"))
    if answer:
        schemas.append((answer, "edged-answer", "json_schema"))
    more = f"{gbnf_literal(frame.separator)} {call}".strip()
    if frame.max_calls is None:
        calls = f"{call} ({more})*"
    elif frame.max_calls == 1:
        calls = call
    else:
        calls = f"{call} ({more}){{0,{frame.max_calls - 1}}}"
    root = " ".join(part for part in (gbnf_literal(frame.open), calls, gbnf_literal(frame.close)) if part)
    if answer:
        root = f"({root}) | {gbnf_literal(header)} edged-answer"
    converted = _convert_all(schemas) if schemas else ""
    return f"root ::= {root}\n{rules}\n{converted}\n"


def _named_calls(frame: ToolCallFrame, schemas: list[tuple[str, str, str]]) -> tuple[str, str]:
    """The call rule of a frame of named calls: one alternative per tool, its name, the id
    part where the frame has one, `args_marker`, then its arguments. The JSON schemas its
    rules use are added to `schemas` (the caller converts them)."""
    tools = list(frame.named_calls.items())
    if frame.arguments_syntax == "xml":
        names, rules = _xml_arguments(tools, frame.xml_parameter, schemas, cdata=frame.xml_cdata)
    elif frame.arguments_syntax == "python":
        names, rules = _python_arguments(tools, schemas)
    elif frame.arguments_syntax == "gemma":
        names, rules = _gemma_arguments(tools)
    else:
        names, rules = [f"tool-args-{i}" for i in range(len(tools))], ""
        schemas += [(schema, f"tool-args-{i}", "tools") for i, (_, schema) in enumerate(tools)]
    ident = f"{gbnf_literal(frame.id_marker)} [a-zA-Z0-9]{{9}} " if frame.id_marker else ""
    marker = gbnf_literal(frame.args_marker)
    alternatives = " | ".join(
        f"{gbnf_literal(name)} {ident}{marker} {rule}".rstrip() for (name, _), rule in zip(tools, names, strict=True)
    )
    return "tool-call", f"tool-call ::= {alternatives}\n{rules}"


# Gemma 4's string marks, around a string value in its object syntax.
GEMMA_QUOTE = '<|"|>'
# Gemma 4's object syntax (ToolCallFrame.arguments_syntax "gemma"), as llama.cpp's grammar for
# it: keys unquoted up to their colon, strings between GEMMA_QUOTE marks ("gemma-string-rest":
# any text up to the closing mark), JSON numbers, booleans and null; whitespace after an
# opening bracket, a comma or a colon and before a closing one.
_GEMMA_RULES = r"""gemma-object ::= "{" gemma-ws ("}" | gemma-member ("," gemma-ws gemma-member)* gemma-ws "}")
gemma-member ::= [^:}]+ ":" gemma-ws gemma-value
gemma-value ::= gemma-string | gemma-object | gemma-array | gemma-number | "true" | "false" | "null"
gemma-string ::= "<|\"|>" gemma-string-rest
gemma-array ::= "[" gemma-ws ("]" | gemma-value ("," gemma-ws gemma-value)* gemma-ws "]")
gemma-number ::= gemma-integer ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,16})?
gemma-integer ::= "-"? ([0-9] | [1-9] [0-9]{1,15})
gemma-ws ::= [ \t\n]{0,20}"""

def _parameters(name: str, schema_json: str) -> tuple[str, Any]:
    """Where a named call's parameters schema is (for errors) and the schema, checked."""
    where = f"tools[{name}].parameters"
    try:
        schema = json.loads(schema_json)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"{where}: not valid JSON: {exc}") from None
    _check(schema, where)
    return where, schema


def _gemma_arguments(tools: list[tuple[str, str]]) -> tuple[list[str], str]:
    """Per tool, the rule of its arguments in Gemma 4's object syntax, held to the tool's
    schema (_GemmaSchema), and all the rules."""
    names, rules = [], [_GEMMA_RULES, gbnf_including("gemma-string-rest", GEMMA_QUOTE)]
    for number, (name, schema_json) in enumerate(tools):
        where, schema = _parameters(name, schema_json)
        converter = _GemmaSchema(schema, f"tool-{number}", rules)
        try:
            _refuse_empty_cycles(_ref_targets(schema, converter.resolve), converter.resolve)
        except ValueError as exc:
            raise InvalidArgument(f"{where}: {exc}") from None
        names.append(converter.rule(converter.value(schema, where, 0)))
    return names, "\n".join(rules)


def _ref_targets(schema: Any, resolve: Callable[[str], Any]) -> dict[str, Any]:
    """Every string `$ref` in `schema` (a property named "$ref" holds a schema, not a string)
    and what it resolves to, where it resolves."""
    found: dict[str, Any] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in found and (target := resolve(ref)) is not None:
                found[ref] = target
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


# Keywords a schema may hold in Gemma 4's syntax beyond those _GemmaSchema writes rules for.
_GEMMA_KEYS = frozenset({"type", "properties", "required", "additionalProperties", "items", "enum", "const",
                         "anyOf", "oneOf", "$ref"}) | _ANNOTATIONS


class _GemmaSchema:
    """A JSON schema as GBNF of Gemma 4's object syntax, the way the JSON converter holds JSON:
    an object's properties by name and schema, the required ones in any order, then optional
    ones, each at most once (other keys only where additionalProperties allows them, then any
    key and value); strings, numbers, integers, booleans, null, lists of items, enums and
    consts of scalars, anyOf / oneOf, local $refs. What it cannot hold is an InvalidArgument
    naming the keyword."""

    def __init__(self, root: Any, prefix: str, rules: list[str]) -> None:
        self.root, self.prefix, self.rules = root, prefix, rules
        self.count = 0
        # A reference's target by its rule, written once: a recursive schema (a tree whose
        # nodes hold a list of nodes) refers to its own rule instead of nesting forever.
        self.targets: dict[int, str] = {}

    def fresh(self) -> str:
        """A rule name not used yet."""
        name = f"{self.prefix}-{self.count}"
        self.count += 1
        return name

    def rule(self, body: str) -> str:
        name = self.fresh()
        self.rules.append(f"{name} ::= {body}")
        return name

    def resolve(self, ref: str) -> Any:
        """A local reference's target (None: it points to nothing)."""
        target: Any = self.root
        for part in _pointer(ref):
            target = target.get(part) if isinstance(target, dict) else None
        return target

    def value(self, schema: Any, where: str, depth: int) -> str:
        if depth > 32:
            raise InvalidArgument(f"{where}: nested too deeply")
        if not isinstance(schema, dict) or not set(schema) - _ANNOTATIONS:
            return "gemma-value"  # true or {}: anything
        extra = sorted(set(schema) - _GEMMA_KEYS)
        if extra:
            raise InvalidArgument(f"{where}: keyword '{extra[0]}' cannot be enforced in Gemma 4's tool-call syntax")
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = self.resolve(ref)
            if target is None:
                raise InvalidArgument(f"{where}.$ref: {ref!r} points to nothing")
            if "type" in schema and (not isinstance(target, dict) or schema["type"] != target.get("type")):
                # Only the target is written: a `type` beside it must say what the target says.
                raise InvalidArgument(f"{where}: keyword 'type' beside '$ref' is not supported unless it is the target's own type")
            name = self.targets.get(id(target))
            if name is None:
                name = self.targets[id(target)] = self.fresh()  # named first: a recursive one ends
                self.rules.append(f"{name} ::= {self.value(target, where, depth + 1)}")
            return name
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return "(" + " | ".join(
                    self.value(alternative, f"{where}.{key}[{index}]", depth + 1)
                    for index, alternative in enumerate(schema[key])
                ) + ")"
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            return "(" + " | ".join(self.literal(value, where) for value in values) + ")"
        kinds = schema.get("type")
        if kinds is None:
            return self.object(schema, where, depth) if "properties" in schema else "gemma-value"
        alternatives = [self.typed(kind, schema, where, depth) for kind in (kinds if isinstance(kinds, list) else [kinds])]
        return alternatives[0] if len(alternatives) == 1 else "(" + " | ".join(alternatives) + ")"

    def typed(self, kind: str, schema: dict[str, Any], where: str, depth: int) -> str:
        if kind == "object":
            return self.object(schema, where, depth)
        if kind == "array":
            items = schema.get("items")
            if isinstance(items, list):
                # Any item would let through what the list's schemas do not hold.
                raise InvalidArgument(f"{where}.items: a list of item schemas cannot be enforced in Gemma 4's tool-call syntax")
            item = self.value(items, f"{where}.items", depth + 1) if isinstance(items, dict) else "gemma-value"
            return self.rule(f'"[" gemma-ws ("]" | {item} ("," gemma-ws {item})* gemma-ws "]")')
        return {"string": "gemma-string", "integer": "gemma-integer", "number": "gemma-number",
                "boolean": '("true" | "false")', "null": '"null"'}[kind]

    def object(self, schema: dict[str, Any], where: str, depth: int) -> str:
        properties = schema.get("properties", {})
        # As the JSON converter: {"type": "object"} alone is any object.
        bare = "properties" not in schema and "additionalProperties" not in schema
        extra = schema.get("additionalProperties")
        declared_only = _declared_and_more(schema)
        if isinstance(extra, dict) and not declared_only and set(extra) - _ANNOTATIONS:
            # Any key and value would let values through that the schema's does not hold.
            raise InvalidArgument(f"{where}.additionalProperties: a schema here is not supported in Gemma 4's syntax")
        if bare or (extra not in (None, False) and not declared_only) or not isinstance(properties, dict):
            return "gemma-object"  # other keys allowed: any key and value
        # Declared properties beside others allowed: the declared ones alone, as the JSON
        # converter's (`_own_refs`): any key and value would let a declared one hold anything.
        required = set(schema.get("required", []))
        needed: list[str] = []
        optional: list[str] = []
        for key, value in properties.items():
            if not key or any(char in key for char in ":}{,<>\n"):
                raise InvalidArgument(f"{where}.properties: {key!r} cannot be written as a Gemma 4 key")
            member = self.rule(f'{gbnf_literal(key)} ":" gemma-ws {self.value(value, f"{where}.properties.{key}", depth + 1)}')
            (needed if key in required else optional).append(member)
        joiner = '"," gemma-ws'
        name = self.fresh()
        body = _any_order(f"{name}-needed", needed, self.rules, joiner=joiner) if needed else ""
        if optional:
            more = _any_order(f"{name}-more", optional, self.rules, some=True, joiner=joiner)
            body = f"{body} ({joiner} {more})?" if body else f"({more})?"
        inner = f" {body} gemma-ws" if body else ""
        return self.rule(f'"{{" gemma-ws{inner} "}}"')

    def literal(self, value: Any, where: str) -> str:
        if isinstance(value, str):
            return gbnf_literal(GEMMA_QUOTE + value + GEMMA_QUOTE)
        if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
            return gbnf_literal(json.dumps(value))
        raise InvalidArgument(f"{where}: an enum or const of objects or lists cannot be enforced in Gemma 4's tool-call syntax")


# A raw-text value in CDATA (MiniCPM5's XML calls): its text is anything up to the first "]]>".
_CDATA = ("<![CDATA[", "]]>")
# Past this many required (or optional) parameters they go in the schema's order, not in any
# order (as llama.cpp's grammar: the rules for any order double with each one). Unlike
# llama.cpp's, an optional parameter comes at most once (a key twice is no JSON object).
_MAX_PERMUTED = 6
# Keywords a raw-text (string) parameter may carry: the grammar enforces an enum or const as
# the literal texts; the rest of a string's constraints have no raw-text rules here.
_XML_STRING_KEYS = frozenset({"type", "enum", "const"}) | _ANNOTATIONS


def _xml_arguments(
    tools: list[tuple[str, str]], tags: tuple[str, str, str], schemas: list[tuple[str, str, str]], *, cdata: bool,
) -> tuple[list[str], str]:
    """Per tool, the rule of its arguments written as XML parameters (ToolCallFrame.arguments_syntax
    "xml", each `tags[0]` key `tags[1]` value `tags[2]`; "" for a tool without parameters) and
    all the rules. A raw-text value is any text up to the first `tags[2]` (the value is the text
    before it); `cdata` (MiniCPM5): one in `<![CDATA[...]]>` or one that holds no "<", since
    llama-server reads a value that starts with `<![CDATA[` as CDATA only."""
    before, after, close = tags
    # What would end the key early or break the tag it sits in.
    forbidden = set("<>\n" + after[:1])

    def parameter(key: str, schema: Any, root: Any, where: str, rule: str, json_values: list[tuple[str, str, str]]) -> str:
        if not key or any(char in key for char in forbidden):
            raise InvalidArgument(f"{where}.properties: {key!r} cannot be written as an XML tool-call parameter")
        value = _xml_value(schema, root, f"{where}.properties.{key}", f"{rule}-value", json_values, close)
        return f"{gbnf_literal(before + key + after)} {value}"

    arguments, rules = _keyword_arguments(tools, parameter, schemas, joiner="", close="")
    if not cdata:
        return arguments, "\n".join([rules, gbnf_including("xml-arg-string", close)])
    string = (
        f"xml-arg-string ::= [^<]* {gbnf_literal(close)} | {gbnf_literal(_CDATA[0])} xml-arg-cdata {gbnf_literal(close)}"
    )
    return arguments, "\n".join([rules, string, gbnf_including("xml-arg-cdata", _CDATA[1])])


def _python_arguments(tools: list[tuple[str, str]], schemas: list[tuple[str, str, str]]) -> tuple[list[str], str]:
    """Per tool, the rule of its arguments written as Python keyword arguments up to the call's
    closing parenthesis (ToolCallFrame.arguments_syntax "python", LFM2's `name(key=value, ...)`
    after `args_marker` "("): each value JSON by its property's schema (a JSON string is a
    Python string; true, false and null are what llama-server's parser takes too); and all the
    rules."""

    def keyword(key: str, schema: Any, root: Any, where: str, rule: str, json_values: list[tuple[str, str, str]]) -> str:
        if not key.isidentifier():
            raise InvalidArgument(f"{where}.properties: {key!r} cannot be written as a Python keyword argument")
        json_values.append((_alone(schema, root), f"{rule}-value", "tools"))
        return f"{gbnf_literal(key + '=')} {rule}-value"

    return _keyword_arguments(tools, keyword, schemas, joiner=gbnf_literal(", "), close=gbnf_literal(")"))


def _keyword_arguments(
    tools: list[tuple[str, str]],
    argument: Callable[[str, Any, Any, str, str, list[tuple[str, str, str]]], str],
    json_values: list[tuple[str, str, str]],
    *, joiner: str, close: str,
) -> tuple[list[str], str]:
    """Per tool, the rule of arguments written one per property, `argument(key, schema, root,
    where, rule, json_values)` the GBNF of one (the JSON values it needs added to
    `json_values`, which the caller converts): the required ones in any order, then optional
    ones, each at most once, `joiner` between two, `close` after them ("" for a tool with
    nothing to write); and all the rules."""
    rules: list[str] = []
    arguments: list[str] = []
    for number, (name, schema_json) in enumerate(tools):
        where, root = _parameters(name, schema_json)
        properties = root.get("properties", {}) if isinstance(root, dict) else {}
        required = set(root.get("required", [])) if isinstance(root, dict) else set()
        needed: list[str] = []
        optional: list[str] = []
        for index, (key, schema) in enumerate(properties.items()):
            rule = f"tool-{number}-arg-{index}"
            rules.append(f"{rule} ::= {argument(key, schema, root, where, rule, json_values)}")
            (needed if key in required else optional).append(rule)
        head = _any_order(f"tool-{number}-args", needed, rules, joiner=joiner) if needed else ""
        more = _any_order(f"tool-{number}-more", optional, rules, some=True, joiner=joiner) if optional else ""
        if head and more:
            body = f"{head} ({joiner} {more})?" if joiner else f"{head} ({more})?"
        else:
            body = head or (f"({more})?" if more else "")
        body = f"{body} {close}".strip()
        if body:
            rules.append(f"tool-{number}-call-args ::= {body}")
        arguments.append(f"tool-{number}-call-args" if body else "")
    return arguments, "\n".join(rules)


def _alone(schema: Any, root: Any) -> str:
    """A property's schema as JSON text on its own, with the definitions its references point
    into (the tool's parameters' `$defs`)."""
    alone = dict(schema) if isinstance(schema, dict) else {}
    for key in ("$defs", "definitions"):
        if isinstance(root, dict) and key in root and key not in alone:
            alone[key] = root[key]
    return json.dumps(alone)


def _xml_value(schema: Any, root: Any, where: str, rule: str, json_values: list[tuple[str, str, str]], end: str) -> str:
    """The GBNF of a parameter's value and the close `end` after it: raw text where the schema
    admits strings, its enum's texts where it has one; else JSON by the schema (its rule
    `rule`, converted with the other JSON values into `json_values`)."""
    types = xml_value_types(schema, root)
    close = gbnf_literal(end)
    if "string" not in types:
        json_values.append((_alone(schema, root), rule, "tools"))
        return f"{rule} {close}"
    if not isinstance(schema, dict):
        return "xml-arg-string"  # true: any value
    extra = sorted(set(schema) - _XML_STRING_KEYS)
    if types != {"string"}:
        # Raw text may be any of the types (read as JSON first): only plain types can be held.
        plain = all(
            isinstance(a, dict) and not set(a) - {"type"} - _ANNOTATIONS
            for a in schema.get("anyOf") or schema.get("oneOf") or []
        )
        extra = [key for key in extra if key not in ("anyOf", "oneOf")] if plain else extra
        extra += [key for key in ("enum", "const") if key in schema]
    if extra:
        raise InvalidArgument(
            f"{where}: keyword '{extra[0]}' cannot be enforced on a value this model writes as raw "
            "text (its XML tool calls)"
        )
    values: Any = [schema["const"]] if "const" in schema else schema.get("enum")
    if types == {"string"} and isinstance(values, list):
        texts = [gbnf_literal(str(value)) or '""' for value in values]
        return f"({' | '.join(texts)}) {close}"
    return "xml-arg-string"


def _any_order(name: str, rules: list[str], out: list[str], *, some: bool = False, joiner: str = "") -> str:
    """`rules` each once, in any order, `joiner` between two (`some`: any of them but at least
    one, each at most once; the caller makes it optional), in their order past _MAX_PERMUTED
    (`some`: then any of them, as often as the model writes them): one rule per subset still
    to write (`name`-mask), added to `out`; the expression to use."""
    between = f" {joiner} " if joiner else " "
    if len(rules) > _MAX_PERMUTED or (len(rules) == 1 and not some):
        if not some:
            return between.join(rules)
        if not joiner:
            return " ".join(f"{rule}?" for rule in rules)
        anyone = f"({' | '.join(rules)})"
        return f"{anyone} ({joiner} {anyone})*"
    built: set[int] = set()

    def rule_of(mask: int) -> str:
        if mask not in built:
            built.add(mask)
            alternatives = []
            for bit, rule in enumerate(rules):
                rest = mask & ~(1 << bit)
                if rest != mask:
                    after = f"{between}{rule_of(rest)}" if rest else ""
                    alternatives.append(f"{rule} ({after.strip()})?" if some and rest else rule + after)
            out.append(f"{name}-{mask} ::= {' | '.join(alternatives)}")
        return f"{name}-{mask}"

    return rule_of((1 << len(rules)) - 1)


def gbnf_including(name: str, delimiter: str) -> str:
    """Rules `name`(-state) for any text up to and including the first `delimiter` (the
    automaton of a search for it: state k has matched its first k characters)."""
    alphabet = sorted(set(delimiter))

    def state(k: int) -> str:
        return name if k == 0 else f"{name}-{k}"

    rules = []
    for k in range(len(delimiter)):
        completing, moves, specific = [], [], []
        for char in alphabet:
            matched = delimiter[:k] + char
            # The longest end of what was read that starts the delimiter.
            after = next(n for n in range(len(matched), -1, -1) if delimiter.startswith(matched[len(matched) - n:]))
            if after == len(delimiter):
                completing.append(char)
            elif after:
                moves.append(f"{_char_class([char])} {state(after)}")
            else:
                continue  # back to the start: as any other character
            specific.append(char)
        alternatives = ([_char_class(completing)] if completing else []) + moves
        alternatives.append(f"{_char_class(specific, negate=True)} {state(0)}")
        rules.append(f"{state(k)} ::= {' | '.join(alternatives)}")
    return "\n".join(rules)


def _char_class(chars: list[str], *, negate: bool = False) -> str:
    escaped = "".join(_CLASS_ESCAPES.get(c, c) for c in chars)
    return f"[{'^' if negate else ''}{escaped}]"


_CLASS_ESCAPES = {"\\": "\\\\", "]": "\\]", "[": "\\[", "^": "\\^", "-": "\\-", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


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
    # "[" of "[TOOL_CALLS][", `<tool_call>` before its newline (and Qwen 3.5's `<function=`),
    # `<|tool_call>` before Gemma 4's `call:`; the grammar then writes the rest of `open`. So
    # the output may end with the marker and any start of what follows it.
    core = trigger_core(frame)
    rest = f"(?:{'|'.join(brace_tails)})?" if brace_tails else ""
    for char in reversed(frame.open[len(core) :]):
        rest = f"(?:{regex_escape(char)}{rest})?"
    return f"({regex_escape(core)}{rest})$"


def trigger_core(frame: ToolCallFrame) -> str:
    """The text whose writing starts a lazy `frame`'s grammar (see tool_call_trigger): the
    frame's `trigger`, else its marker ("" for an empty `open`: a first "{" starts it)."""
    if frame.trigger:
        if not frame.open.startswith(frame.trigger):
            raise InvalidArgument("tool_calls.trigger: must be a start of open")
        return frame.trigger
    marker = re.match(r"[^>\]]*[>\]]", frame.open)
    return marker.group(0) if marker else frame.open.rstrip(" \t\r\n[{") or frame.open


def _pattern_atoms(pattern: str) -> int:
    """How many characters and classes the converter writes for a regular expression: a
    counted repetition ({m}, {m,}, {m,n}) writes its item out as often as its largest count
    (nested ones multiply); every alternative of a group is written; `*`, `+` and `?` write
    nothing more (the grammar repeats them). ValueError for what the converter would misread
    or never finish: a count past MAX_REPETITIONS or with its minimum above its maximum, a "}"
    that closes no "{" and an empty class ("[]", "[^]"), on which it loops without end, a
    quantifier with nothing to repeat (its IndexError) and a lazy one (read as optional)."""
    groups: list[list[int]] = [[0]]  # per open group, the size of each alternative so far
    last = 0  # what a quantifier here repeats (0: nothing)
    repeated = False  # the token before was a quantifier
    i = 0
    while i < len(pattern):
        char = pattern[i]
        count = _PATTERN_COUNT.match(pattern, i) if char == "{" else None
        if (count is not None or char in "*+?") and not last:
            raise ValueError(f"{(count.group() if count else char)!r} at {i} has nothing to repeat")
        if char == "?" and repeated:
            # The converter reads it as "optional" ((a|b){2}? as one or two): a lazy quantifier
            # matches what the greedy one does in a whole-string pattern, so it says nothing.
            raise ValueError(f"the lazy quantifier at {i} is not supported (drop its '?': it matches the same)")
        repeated = count is not None or char in "*+?"
        if count is not None:
            low, high = count[1], count[2]
            bounds = [int(n) for n in (low, high) if n]
            if any(n > MAX_REPETITIONS for n in bounds):
                raise ValueError(f"repetition {count.group()} counts past {MAX_REPETITIONS}")
            if low and high and int(low) > int(high):
                raise ValueError(f"repetition {count.group()} has its minimum above its maximum")
            times = max([*bounds, 1]) + (1 if high == "" else 0)  # {m,}: m copies and a star
            groups[-1][-1] += last * (times - 1)
            last *= times
            i = count.end()
        elif char == "(":
            groups.append([0])
            last = 0
            i += 3 if pattern.startswith("(?:", i) else 1
        elif char == ")" and len(groups) > 1:
            last = sum(groups.pop())
            groups[-1][-1] += last
            i += 1
        elif char == "|":
            groups[-1].append(0)
            last = 0
            i += 1
        elif char in "*+?^$":
            last = last if char in "*+?" else 0
            i += 1
        elif char == "}":
            raise ValueError(f"'}}' at {i} closes no '{{' (a literal one is written '\\}}')")
        else:
            if char == "[":
                if pattern.startswith(("[]", "[^]"), i):
                    raise ValueError(f"the empty character class at {i} ('[]' or '[^]') is not supported")
                end = _CLASS_END.search(pattern, i + 1)
                i = end.end() if end else len(pattern)
            else:
                i += 2 if char == "\\" else 1
            last = 1
            groups[-1][-1] += 1
    return sum(sum(alternatives) for alternatives in groups)


# A regular expression's counted repetition ({m}, {m,}, {m,n}), matched where a "{" is not
# escaped (_pattern_atoms walks the escapes).
_PATTERN_COUNT = re.compile(r"\{([0-9]*)(?:,([0-9]*))?\}")
# The end of a character class: the first "]" no backslash escapes (one right after "[" or
# "[^" is a member, as in ECMAScript it is not: close enough for a size).
_CLASS_END = re.compile(r"(?<!\\)\]")
_REPETITION = re.compile(r"\{\s*(?P<low>[0-9]*)\s*(?:,\s*(?P<high>[0-9]*)\s*)?\}")
# What holds no groups: a literal, a character class (a backslash escapes the next character in
# both), a comment. An unterminated one stays, and its brackets count: the check errs on the
# safe side.
_OPAQUE = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*')


def check_grammar(text: str, name: str) -> None:
    """InvalidArgument naming `name` for a GBNF text past the bounds llama.cpp's parser is
    safe within (MAX_GRAMMAR_BYTES, MAX_GRAMMAR_NESTING, MAX_GRAMMAR_RULES, a repetition's
    bounds in order); said before it is parsed. Regular expressions and numpy over texts of
    megabytes: tens of milliseconds, so off the loop (the backend's _with_grammar)."""
    size = len(text.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise InvalidArgument(f"{name}: {size} bytes, more than the {MAX_GRAMMAR_BYTES} a grammar may have")
    bare = _OPAQUE.sub(" ", text)
    rules = bare.count("::=")
    if rules > MAX_GRAMMAR_RULES:
        raise InvalidArgument(f"{name}: {rules} rules, more than the {MAX_GRAMMAR_RULES} a grammar may have")
    codes = np.frombuffer(bare.encode(), dtype=np.uint8)
    depth = np.cumsum((codes == ord("(")).astype(np.int64) - (codes == ord(")")))
    deepest = int(depth.max()) if depth.size else 0
    if deepest > MAX_GRAMMAR_NESTING:
        raise InvalidArgument(f"{name}: groups nested {deepest} deep, more than the {MAX_GRAMMAR_NESTING} allowed")
    for bounds in _REPETITION.finditer(bare):
        # A minimum above the maximum: llama.cpp's parser counts the optional copies as
        # max - min in an unsigned size and allocates until the process runs out of memory.
        if bounds["low"] and bounds["high"] and int(bounds["low"]) > int(bounds["high"]):
            raise InvalidArgument(f"{name}: repetition {bounds.group()} has its minimum above its maximum")


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


def _of_type(value: Any, kind: str) -> bool:
    """Whether a JSON value is of a JSON Schema type (an integer may be written 1.0)."""
    if kind == "integer":
        return (type(value) is int) or (type(value) is float and value.is_integer())
    if kind == "number":
        return type(value) in (int, float)
    return isinstance(value, {"string": str, "boolean": bool, "null": type(None), "object": dict, "array": list}[kind])


def _check_together(schema: dict[str, Any], where: str, declared: list[Any] | None, in_all_of: bool) -> None:
    """What the converter would write wrongly from keywords as they stand together: empty
    lists, keywords it writes alone and drops the rest beside, values and branches of another
    type than the schema's, required names without a schema. `declared`: the schema's types."""
    kinds = schema.get("type")
    for key in ("type", "enum", "anyOf", "oneOf", "allOf", "prefixItems", "items"):
        if schema.get(key) == []:
            # The converter writes an empty rule for the first four, which llama.cpp refuses
            # naming no field, and fails on an empty `items`; JSON Schema wants the rest
            # non-empty.
            raise InvalidArgument(f"{where}.{key}: an empty array " + (
                "matches nothing" if key in ("type", "enum", "anyOf", "oneOf") else "is not a schema here"))
    enforced = schema.keys() & _ENFORCED - {"$ref"}  # keywords beside a $ref: refused below
    for alone in ("enum", "const", "anyOf", "oneOf"):
        # The converter writes these alone and drops what stands beside them (a type aside,
        # which the values are checked against below, or which the branches carry): an enum's
        # value longer than a maxLength, or an object's properties beside a oneOf, went out
        # unchecked.
        beside = sorted(enforced - {alone, "type"}) if alone in schema else []
        if beside:
            raise InvalidArgument(f"{where}: keyword '{beside[0]}' beside '{alone}' is not supported for structured output")
    for alone in ("anyOf", "oneOf"):
        branches = schema.get(alone)
        if declared is not None and isinstance(branches, list):
            for index, branch in enumerate(branches):
                theirs = branch.get("type") if isinstance(branch, dict) else None
                for kind in theirs if isinstance(theirs, list) else [theirs] if theirs is not None else []:
                    if kind not in declared and not (kind == "integer" and "number" in declared):
                        raise InvalidArgument(f"{where}.{alone}[{index}]: type {kind!r} is not among the types beside it")
    if "prefixItems" in schema and schema.get("items", False) is not False:
        # The converter reads `items` and drops `prefixItems` (`false`, no more items, it
        # skips: the tuple alone is what that means).
        raise InvalidArgument(f"{where}: keyword 'items' beside 'prefixItems' is not supported for structured output")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise InvalidArgument(f"{where}.enum: must be an array")
    if declared is not None:
        # The converter writes the values alone: one of another type would be generated.
        for value in [*(schema.get("enum") or []), *([schema["const"]] if "const" in schema else [])]:
            if not any(_of_type(value, kind) for kind in declared):
                raise InvalidArgument(
                    f"{where}: the value {json.dumps(value)[:60]} in enum/const is not of its type {json.dumps(kinds)}")
    extra = schema.get("additionalProperties")
    if extra is not None and not isinstance(extra, bool | dict):
        raise InvalidArgument(f"{where}.additionalProperties: must be a boolean or a schema")
    required = schema.get("required")
    if required is not None:
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            raise InvalidArgument(f"{where}.required: must be an array of property names")
        properties = schema.get("properties")
        # Inside an allOf (or beside one) the converter merges the parts' properties and
        # required names; elsewhere it enforces a required name only where it has its schema.
        missing = [name for name in required if not isinstance(properties, dict) or name not in properties]
        if missing and not in_all_of and "allOf" not in schema:
            raise InvalidArgument(
                f"{where}.required: '{missing[0]}' has no schema in 'properties'; structured output "
                "can only require a property it knows")


def _check(schema: Any, where: str, depth: int = 0, in_all_of: bool = False) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        # The converter recurses per level, in Python and then in llama.cpp's parser.
        raise InvalidArgument(f"{where}: nested more than {MAX_SCHEMA_DEPTH} levels deep")
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
    declared = kinds if isinstance(kinds, list) else [kinds] if kinds is not None else None
    for kind in declared or []:
        # Checked as text first: a list or an object there cannot be looked up in a set.
        if not isinstance(kind, str) or kind not in _TYPES:
            raise InvalidArgument(f"{where}.type: unknown type {kind!r}")
    _check_together(schema, where, declared, in_all_of)
    if "format" in schema:
        if not isinstance(schema["format"], str) or schema["format"] not in _FORMATS:
            raise InvalidArgument(f"{where}.format: '{schema['format']}' is not supported for structured output")
        if {"pattern", "minLength", "maxLength"} & schema.keys():
            raise InvalidArgument(f"{where}: 'format' cannot be combined with pattern/minLength/maxLength")
    for low, high in (("minLength", "maxLength"), ("minItems", "maxItems")):
        for key in (low, high):
            value = schema.get(key)
            if key in schema and (type(value) is not int or not 0 <= value <= MAX_REPETITIONS):
                # The converter writes each repetition out (20 000 nested optional groups
                # overflowed llama.cpp's parser's stack); past ~1 400 llama.cpp refuses them.
                raise InvalidArgument(f"{where}.{key}: must be an integer from 0 to {MAX_REPETITIONS}, got {value!r}")
        if schema.get(low, 0) > schema.get(high, MAX_REPETITIONS):
            raise InvalidArgument(f"{where}.{low}: more than {high}")
    if "pattern" in schema and {"minLength", "maxLength"} & schema.keys():
        raise InvalidArgument(f"{where}: 'pattern' cannot be combined with minLength/maxLength")
    if isinstance(schema.get("pattern"), str):
        # The converter writes a repeated character out as text before the grammar's size is
        # known (a{2147483647} took 6 GB and 25 s, a{10**20} was a 500) and loops without end
        # on a lone "}".
        try:
            atoms = _pattern_atoms(schema["pattern"])
        except ValueError as exc:
            raise InvalidArgument(f"{where}.pattern: {exc}") from None
        if atoms > MAX_PATTERN_ATOMS:
            # Nested counts multiply: ((a{1000}){1000}){1000} kept the converter busy for minutes.
            raise InvalidArgument(f"{where}.pattern: its counted repetitions write out {atoms} characters and "
                                  f"classes, more than the {MAX_PATTERN_ATOMS} a grammar may have")
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise InvalidArgument(f"{where}.$ref: only local references ('#/...') are supported")
    # A `type` beside it is checked against the target where references resolve (_own_refs).
    beside = sorted(set(schema) & _ENFORCED - {"$ref", "type"}) if ref is not None else []
    if beside:
        # The converter writes a `$ref`'s target alone and drops what stands beside it (JSON
        # Schema holds to both): an enum there let any value of the target through.
        raise InvalidArgument(f"{where}: keyword '{beside[0]}' beside '$ref' is not supported for structured output")
    if "allOf" in schema and kinds not in (None, "object"):
        raise InvalidArgument(f"{where}.allOf: only supported for objects")
    for key in ("properties", "$defs", "definitions"):
        children = schema.get(key, {})
        if not isinstance(children, dict):
            raise InvalidArgument(f"{where}.{key}: must be an object")
        for name, child in children.items():
            _check(child, f"{where}.{key}.{name}", depth + 1)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        children = schema.get(key, [])
        if not isinstance(children, list):
            raise InvalidArgument(f"{where}.{key}: must be an array")
        for index, child in enumerate(children):
            _check(child, f"{where}.{key}[{index}]", depth + 1, in_all_of=key == "allOf")
    items = schema.get("items")
    if isinstance(items, list):
        for index, child in enumerate(items):
            _check(child, f"{where}.items[{index}]", depth + 1)
    elif items is not None:
        _check(items, f"{where}.items", depth + 1)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        _check(extra, f"{where}.additionalProperties", depth + 1)
