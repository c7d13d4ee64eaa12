"""Native tool-call syntaxes: reading whole and growing replies, frames, streamed == unstreamed."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import msgspec
import pytest

from daemon.api import openai_tools
from daemon.api.reasoning import ChannelSplit
from daemon.api.tool_syntax import GENERIC, syntax_named
from daemon.backend import GenerateParams
from daemon.errors import InvalidArgument

TOOLS = msgspec.convert(
    [
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "lights_off"}},
    ],
    list[openai_tools.Tool],
)
# A tool's parameters as a call's schema holds them: a JSON Schema document of their own, so
# that their local references keep meaning their own root (openai_tools.own_document).
EMBEDDED = {"$id": "edged:tool/get_weather", **(TOOLS[0].function.parameters or {})}
ARGUMENTS = [{"city": 'Pa"ris \\ \u00e9 \U0001F600', "n": [1, {"x": "}]"}]}, {}]


def _hermes(content: str, calls: list[tuple[str, object]]) -> str:
    body = "\n</tool_call>\n<tool_call>\n".join(json.dumps({"name": n, "arguments": a}) for n, a in calls)
    return f"{content}<tool_call>\n{body}\n</tool_call>"


def _mistral(content: str, calls: list[tuple[str, object]]) -> str:
    body = ", ".join(json.dumps({"name": n, "arguments": a, "id": "abcDEF123"}) for n, a in calls)
    return f"{content}[TOOL_CALLS][{body}]"


def _nemotron(content: str, calls: list[tuple[str, object]]) -> str:
    """Nemotron Nano v2's template: one list in `<TOOLCALL>`, ", " between the calls."""
    body = ", ".join(json.dumps({"name": n, "arguments": a}) for n, a in calls)
    return f"{content}<TOOLCALL>[{body}]</TOOLCALL>"


def _apertus(content: str, calls: list[tuple[str, object]]) -> str:
    """Apertus's template: one list, each call an object keyed by the tool's name."""
    body = ", ".join(json.dumps({n: a}) for n, a in calls)
    return f"{content}<|tools_prefix|>[{body}]<|tools_suffix|>"


def _llama3(content: str, calls: list[tuple[str, object]]) -> str:
    assert not content and len(calls) == 1
    return json.dumps({"name": calls[0][0], "parameters": calls[0][1]})


def _named(content: str, calls: list[tuple[str, object]], ident: bool) -> str:
    id_part = "[CALL_ID]abcDEF123" if ident else ""
    return content + "".join(f"[TOOL_CALLS]{n}{id_part}[ARGS]{json.dumps(a)}" for n, a in calls)


def _xml(content: str, calls: list[tuple[str, dict[str, object]]]) -> str:
    """Qwen 3.5's template: strings raw, other values as JSON."""
    def value(v: object) -> str:
        return v if isinstance(v, str) else json.dumps(v)

    return content + "\n".join(
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>"
        for n, a in calls
    )


def _gemma_value(v: object) -> str:
    if isinstance(v, str):
        return f'<|"|>{v}<|"|>'
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_gemma_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_gemma_value(x) for x in v) + "]"
    return json.dumps(v)


def _gemma(content: str, calls: list[tuple[str, dict[str, object]]]) -> str:
    """Gemma 4's template: `<|tool_call>call:name{key:value,...}<tool_call|>` per call."""
    return content + "".join(f"<|tool_call>call:{n}{_gemma_value(a)}<tool_call|>" for n, a in calls)


def _deepseek_r1(content: str, calls: list[tuple[str, object]]) -> str:
    """DeepSeek R1's templates: one section, per call the tool's type and name, its arguments
    in a JSON code block; a newline between two calls."""
    body = "\n".join(
        f"<\uff5ctool\u2581call\u2581begin\uff5c>function<\uff5ctool\u2581sep\uff5c>{n}\n```json\n{json.dumps(a)}\n```"
        "<\uff5ctool\u2581call\u2581end\uff5c>"
        for n, a in calls
    )
    return f"{content}<\uff5ctool\u2581calls\u2581begin\uff5c>{body}<\uff5ctool\u2581calls\u2581end\uff5c>"


BOTH = [("get_weather", ARGUMENTS[0]), ("lights_off", ARGUMENTS[1])]
REPLIES = {
    "hermes": _hermes("Let me look.\n", BOTH),
    "mistral": _mistral("", BOTH),
    "mistral_args": _named("Let me look.\n", BOTH, ident=False),
    "mistral_call_id": _named("Let me look.\n", BOTH, ident=True),
    "llama3": _llama3("", [("get_weather", ARGUMENTS[0])]),
    "nemotron_v2": _nemotron("Let me look.\n", BOTH),
    "apertus": _apertus("Let me look.\n", BOTH),
    "qwen3_coder": _xml("Let me look.\n\n", BOTH),  # "n" is no declared parameter: any type
    "gemma4": _gemma("Let me look.\n", BOTH),
    "deepseek_r1": _deepseek_r1("Let me look.\n", BOTH),
}
NATIVE = list(REPLIES)


def test_unknown_names_read_the_generic_reply() -> None:
    assert syntax_named("") is GENERIC and syntax_named("functionary") is GENERIC
    assert [syntax_named(n).name for n in NATIVE] == NATIVE


@pytest.mark.parametrize("name", NATIVE)
def test_whole_reply(name: str) -> None:
    use = openai_tools.ToolUse(name, TOOLS, "auto", parallel=True)
    content, calls = use.reply(REPLIES[name], cut=False)
    expected = [("get_weather", ARGUMENTS[0]), ("lights_off", ARGUMENTS[1])][: len(calls)]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    assert len(calls) == (1 if name == "llama3" else 2)
    # Content before the calls, without the whitespace that led up to them (Apertus: with it,
    # as llama-server's automatic parser reads it).
    before = "Let me look.\n" if name == "apertus" else "Let me look."
    assert content == (before if REPLIES[name].startswith("Let") else None)
    assert use.reply_calls(REPLIES[name]) == (content, expected)
    # Mistral's template takes back only ids of 9 letters and digits.
    pattern = r"[A-Za-z0-9]{9}" if name.startswith("mistral") else r"call_[0-9a-f]{24}"
    assert all(re.fullmatch(pattern, c["id"]) for c in calls)


@pytest.mark.parametrize("name", NATIVE)
def test_answers_without_calls_are_content(name: str) -> None:
    use = openai_tools.ToolUse(name, TOOLS, "auto", parallel=True)
    text = "Paris is sunny. <tool_ca" if name == "hermes" else "Paris is sunny.\n"
    assert use.reply(text, cut=False) == (text, [])
    assert use.reply_calls(text) == (text, [])


@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_stream_deltas_rebuild_the_reply(name: str, step: int) -> None:
    reply = REPLIES[name]
    use = openai_tools.ToolUse(name, TOOLS, "auto", parallel=True)
    stream = use.stream()
    pieces = [reply[k : k + step] for k in range(0, len(reply), step)]
    deltas = [d for i, p in enumerate(pieces) for d in stream.feed(p, final=i == len(pieces) - 1)]
    content = "".join(d.get("content", "") for d in deltas)
    assert content == (use.reply(reply, cut=False)[0] or "")
    heads = [c for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    arguments: dict[int, str] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            arguments[call["index"]] = arguments.get(call["index"], "") + call["function"].get("arguments", "")
    names = [h["function"]["name"] for h in heads]
    assert names == ["get_weather", "lights_off"][: len(heads)]
    assert [json.loads(arguments[i]) for i in range(len(heads))] == ARGUMENTS[: len(heads)]


@pytest.mark.parametrize("step", [1, 4])
def test_stream_holds_back_a_possible_call_start(step: int) -> None:
    """Text that might begin `<tool_call>` (and whitespace before it) waits; once it is
    plainly text, or the reply ends, it goes out: streamed content == unstreamed content."""
    use = openai_tools.ToolUse("hermes", TOOLS, "auto", parallel=True)
    stream = use.stream()
    assert stream.feed("It is <tool") == [{"content": "It is"}]
    assert stream.feed("box") == [{"content": " <toolbox"}]
    assert stream.feed(" \n") == []
    assert stream.feed("", final=True) == [{"content": " \n"}]
    for text in ("Answer <tool_c", "Answer\n\n"):
        stream = use.stream()
        pieces = [text[k : k + step] for k in range(0, len(text), step)]
        sent = "".join(d.get("content", "") for i, p in enumerate(pieces)
                       for d in stream.feed(p, final=i == len(pieces) - 1))
        assert sent == use.reply(text, cut=False)[0] == text


def test_llama3_decides_on_the_first_character() -> None:
    use = openai_tools.ToolUse("llama3", TOOLS, "auto", parallel=True)
    stream = use.stream()
    assert stream.feed("  ") == []
    assert stream.feed("{\"na") == [] and stream.calls_sent == 0
    stream = use.stream()
    assert stream.feed(" Sun") == [{"content": " Sun"}]


def test_cut_reply_keeps_calls_named_so_far() -> None:
    use = openai_tools.ToolUse("hermes", TOOLS, "auto", parallel=True)
    text = 'Hm<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    content, calls = use.reply(text, cut=True)
    assert content == "Hm" and [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Pa'}]
    # Ollama's whole calls: one without complete arguments is left out.
    assert use.reply_calls(text) == ("Hm", [])


def test_frames_follow_tool_choice_and_syntax() -> None:
    def frame(name: str, choice: openai_tools.ToolChoice | None, parallel: bool = True) -> dict[str, object]:
        params = GenerateParams()
        openai_tools.ToolUse(name, TOOLS, choice, parallel).constrain(params)
        assert params.tool_calls is not None and not params.json_schema
        return msgspec.to_builtins(params.tool_calls)

    hermes = frame("hermes", "auto")
    assert (hermes["open"], hermes["separator"], hermes["close"]) == (
        "<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>")
    assert hermes["lazy"] is True and hermes.get("max_calls") is None
    schema = json.loads(str(hermes["call_schema"]))
    assert [b["properties"]["name"]["const"] for b in schema["anyOf"]] == ["get_weather", "lights_off"]
    assert schema["anyOf"][0]["properties"]["arguments"] == EMBEDDED
    required = frame("hermes", "required", parallel=False)
    assert required["lazy"] is False and required["max_calls"] == 1
    named = msgspec.convert({"type": "function", "function": {"name": "lights_off"}}, openai_tools.NamedToolChoice)
    only = json.loads(str(frame("mistral", named)["call_schema"]))
    assert only["properties"]["name"] == {"const": "lights_off"}
    assert only["properties"]["id"]["pattern"] == "^[a-zA-Z0-9]{9}$" and only["required"] == ["name", "arguments", "id"]
    for syntax, id_marker in (("mistral_args", ""), ("mistral_call_id", "[CALL_ID]")):
        named_frame = frame(syntax, "required", parallel=False)
        assert (named_frame["open"], named_frame["separator"], named_frame["args_marker"], named_frame["id_marker"]) == (
            "[TOOL_CALLS]", "[TOOL_CALLS]", "[ARGS]", id_marker)
        assert named_frame["max_calls"] == 1 and named_frame["call_schema"] == ""
        assert {k: json.loads(v) for k, v in named_frame["named_calls"].items()} == {
            "get_weather": EMBEDDED,
            "lights_off": {"$id": "edged:tool/lights_off", "type": "object", "properties": {}, "additionalProperties": False}}
    llama = frame("llama3", "auto", parallel=True)
    assert llama["open"] == "" and llama["max_calls"] == 1  # Llama 3.x: one call per turn
    assert set(json.loads(str(llama["call_schema"]))["anyOf"][0]["properties"]) == {"name", "parameters"}
    with pytest.raises(InvalidArgument, match="no tool named 'nope'"):
        frame("hermes", msgspec.convert({"type": "function", "function": {"name": "nope"}},
                                        openai_tools.NamedToolChoice))
    with pytest.raises(InvalidArgument, match="function names must be unique"):
        openai_tools.ToolUse("hermes", [TOOLS[0], TOOLS[0]], "auto", True).constrain(GenerateParams())


def test_generic_use_keeps_the_json_reply() -> None:
    use = openai_tools.ToolUse("", TOOLS, "auto", parallel=True)
    params = GenerateParams()
    use.constrain(params)
    assert params.tool_calls is None and json.loads(params.json_schema)["anyOf"]
    assert use.template_tools() is None
    assert use.messages([{"role": "user", "content": "hi"}])[0]["role"] == "system"
    native = openai_tools.ToolUse("hermes", TOOLS, "auto", parallel=True)
    assert native.messages([{"role": "user", "content": "hi"}]) == [{"role": "user", "content": "hi"}]
    assert native.template_tools() == [msgspec.to_builtins(t) for t in TOOLS]


def test_whitespace_the_grammar_allows_after_a_call() -> None:
    # llama.cpp's JSON grammar lets whitespace follow each value, also before "\n</tool_call>".
    text = ('<tool_call>\n{"name": "lights_off", "arguments": {}} \n\n</tool_call>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    use = openai_tools.ToolUse("hermes", TOOLS, "auto", parallel=True)
    assert use.reply_calls(text) == (None, [("lights_off", {}), ("get_weather", {"city": "Oslo"})])
    mistral = openai_tools.ToolUse("mistral", TOOLS, "auto", parallel=True)
    text = '[TOOL_CALLS][{"name": "lights_off", "arguments": {}, "id": "abcDEF123"} , {"name": "lights_off", "arguments": {}, "id": "abcDEF123"} ]'
    assert len(mistral.reply(text, cut=False)[1]) == 2


@pytest.mark.parametrize("cut", [True, False])
def test_a_call_that_never_got_its_name_streams_as_its_text(cut: bool) -> None:
    use = openai_tools.ToolUse("hermes", TOOLS, "auto", parallel=True)
    text = 'Hm\n<tool_call>\n{"na'
    stream = use.stream()
    sent = "".join(d.get("content", "") for piece in (text[:5], text[5:]) for d in stream.feed(piece, piece == text[5:]))
    assert use.reply(text, cut=cut) == (text, []) and sent == text


@pytest.mark.parametrize("syntax", ["", "hermes"])
@pytest.mark.parametrize("name", ['a"b', "get weather", "x\n<tool_call>", "", "w" * 65, "a<b>"])
def test_tool_names_are_openais(syntax: str, name: str) -> None:
    # A name goes into the grammar and the prompt: quotes, spaces, newlines or markup would
    # break them (llama.cpp answered "could not parse the grammar", naming no field).
    tools = msgspec.convert([{"type": "function", "function": {"name": "fs.read:ok_1-x"}},
                             {"type": "function", "function": {"name": name}}], list[openai_tools.Tool])
    with pytest.raises(InvalidArgument, match=r"tools\[1\]\.function\.name: .* letters, digits, underscores, dashes, dots or colons"):
        openai_tools.ToolUse(syntax, tools, "required", parallel=True).constrain(GenerateParams())
    openai_tools.ToolUse(syntax, tools[:1], "required", parallel=True).constrain(GenerateParams())


XML_TOOLS = msgspec.convert(
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "maybe": {"type": ["string", "null"]},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "o": {"$ref": "#/$defs/o"},
    }, "$defs": {"o": {"type": "object"}}}}}],
    list[openai_tools.Tool],
)


@pytest.mark.parametrize("values, arguments", [
    # A string parameter is its raw text, whatever it looks like.
    ({"s": "123"}, '{"s":"123"}'),
    ({"s": 'two\nlines "quoted" </parameter> é'}, '{"s":"two\\nlines \\"quoted\\" </parameter> é"}'),
    ({"s": ""}, '{"s":""}'),
    # JSON text as written, without the whitespace the grammar allows after it.
    ({"i": "3 ", "o": '{"a": [1, 2]}'}, '{"i":3,"o":{"a": [1, 2]}}'),
    # Where a string and other types are allowed: JSON of an allowed type first, else text.
    ({"maybe": "null", "either": "7"}, '{"maybe":null,"either":7}'),
    ({"maybe": "None", "either": "[7]"}, '{"maybe":"None","either":"[7]"}'),
    # An undeclared parameter may be anything.
    ({"x": "true"}, '{"x":true}'),
])
def test_xml_values_are_read_by_their_types(values: dict[str, str], arguments: str) -> None:
    use = openai_tools.ToolUse("qwen3_coder", XML_TOOLS, "required", parallel=True)
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    text = f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"
    content, calls = use.reply(text, cut=False)
    assert content is None and [c["function"]["arguments"] for c in calls] == [arguments]
    for step in (1, 3):
        stream = use.stream()
        pieces = [text[k : k + step] for k in range(0, len(text), step)]
        deltas = [d for i, p in enumerate(pieces) for d in stream.feed(p, final=i == len(pieces) - 1)]
        streamed = "".join(c["function"].get("arguments", "") for d in deltas for c in d.get("tool_calls", []))
        assert streamed == arguments


def test_xml_stream_holds_back_what_may_close_a_value() -> None:
    use = openai_tools.ToolUse("qwen3_coder", XML_TOOLS, "required", parallel=True)
    stream = use.stream()
    head = stream.feed("<tool_call>\n<function=f>\n<parameter=s>\nab\n</para")
    assert head[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert [d["tool_calls"][0]["function"]["arguments"] for d in head[1:]] == ['{"s":"ab']
    # Not the close after all: the held text is the value's.
    assert stream.feed("graph") == [{"tool_calls": [{"index": 0, "function": {"arguments": "\\n</paragraph"}}]}]
    # A cut reply (max_tokens) sends what it has.
    assert use.reply("<tool_call>\n<function=f>\n<parameter=i>\n12", cut=True)[1][0]["function"]["arguments"] == '{"i":12'


def streamed_calls(use: openai_tools.ToolUse, text: str) -> list[tuple[str, str]]:
    """(name, arguments) of the calls `text` streams as, fed three characters at a time."""
    stream = use.stream()
    pieces = [text[k : k + 3] for k in range(0, len(text), 3)]
    deltas = [d for i, p in enumerate(pieces) for d in stream.feed(p, final=i == len(pieces) - 1)]
    streamed: list[list[str]] = []
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            if call["index"] == len(streamed):
                streamed.append([call["function"]["name"], ""])
            streamed[call["index"]][1] += call["function"].get("arguments", "")
    return [(name, arguments) for name, arguments in streamed]


def check_reading(syntax: str, text: str, reply: dict, marker: str) -> None:
    """An oracle reply's text (its reasoning split off) read as llama-server read it: with its
    request's tools, the same names, arguments text and content, whole and streamed; without
    tools (or tool_choice none), all content. A reply cut before a call's name is complete
    (`marker` begins the calls) is its raw text, as for every syntax here (llama-server leaves
    the call's start out)."""
    request, message = reply["request"], reply["message"]
    tools = request.get("tools") if request.get("tool_choice") != "none" else None
    if tools is None:
        assert text == message["content"]
        return
    use = openai_tools.ToolUse(syntax, msgspec.convert(tools, list[openai_tools.Tool]),
                               request.get("tool_choice"), request.get("parallel_tool_calls", True))
    content, calls = use.reply(text, cut=reply["finish_reason"] == "length")
    expected = [(c["name"], c["arguments"]) for c in message.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
    assert streamed_calls(use, text) == expected
    if not calls and marker in text:
        assert (content, reply["finish_reason"]) == (text, "length") and text.startswith(message["content"])
    else:
        assert (content or "") == message["content"]


XML_ORACLE = json.loads((Path(__file__).parent.parent / "fixtures" / "chat_templates" / "xml_tool_replies.json").read_text())


@pytest.mark.parametrize("reply", [r for r in XML_ORACLE["replies"] if r["raw"] is not None],
                         ids=lambda r: f"{r['case']}-{r['seed']}-{r['request']['max_tokens']}")
def test_xml_replies_read_as_llama_server_reads_them(reply: dict) -> None:
    """xml_tool_replies.json (see the fixtures' README): llama-server's own reading of replies
    generated under its grammar on a tiny GGUF with Qwen 3.5's template, complete and cut:
    the same content, reasoning, names and arguments text, whole and streamed."""
    request = reply["request"]
    tools = msgspec.convert(request["tools"], list[openai_tools.Tool])
    use = openai_tools.ToolUse("qwen3_coder", tools, request["tool_choice"], request.get("parallel_tool_calls", True))
    text, thought = reply["raw"], None
    if request.get("chat_template_kwargs", {}).get("enable_thinking", True):
        # The prompt ends with "<think>\n": the reply starts inside the reasoning.
        thought, text = syntax_named("qwen3_coder").thinking_split(("<think>", "</think>"), "\n").feed(text, True)
    cut = reply["finish_reason"] == "length"
    content, calls = use.reply(text, cut=cut)
    message = reply["message"]
    expected = [(c["name"], c["arguments"]) for c in message.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
    # llama-server also drops the whitespace the content starts with (edged streams it as it
    # comes, before it is known whether a call follows).
    assert (content or "").lstrip() == (message.get("content") or "")
    # The whitespace that opens the reasoning (the "\n" after the prompt's <think>) dropped.
    assert thought == message.get("reasoning_content", thought)
    assert streamed_calls(use, text) == expected


GEMMA_ORACLE = json.loads((Path(__file__).parent.parent / "fixtures" / "chat_templates" / "gemma4_replies.json").read_text())


@pytest.mark.parametrize("reply", [r for r in GEMMA_ORACLE["replies"] if r.get("raw") and r["request"].get("tools")],
                         ids=lambda r: f"{r['case']}-{r['seed']}-{r['request']['max_tokens']}")
def test_gemma_replies_read_as_llama_server_reads_them(reply: dict) -> None:
    """gemma4_replies.json (see the fixtures' README): llama-server's reading of Gemma 4 tool
    calls its grammar let a tiny random model write (keys and strings holding markers, cut
    anywhere): the same names and arguments text, whole and streamed."""
    request = reply["request"]
    tools = msgspec.convert(request["tools"], list[openai_tools.Tool])
    use = openai_tools.ToolUse("gemma4", tools, request.get("tool_choice"), request.get("parallel_tool_calls", True))
    text = reply["raw"]
    thinking = request.get("chat_template_kwargs", {}).get("enable_thinking", True)
    if thinking:
        _, text = syntax_named("gemma4").thinking_split(("<|channel>thought", "<channel|>"), None).feed(text, True)
    content, calls = use.reply(text, cut=reply["finish_reason"] == "length")
    message = reply["message"]
    expected = [(c["name"], c["arguments"]) for c in message.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
    # llama-server drops the text after a stray <channel|> in the content; edged keeps it.
    kept = (content or "").removeprefix(message.get("content") or "")
    assert kept == "" or kept.startswith("<channel|>"), content
    assert streamed_calls(use, text) == expected


def test_a_gemma_value_nested_past_reason_stays_text() -> None:
    # The reader recurses: nesting a model could write forever is read no further than 64
    # levels, and the reply is its text (a complete call nested less deep reads as usual).
    use = openai_tools.ToolUse("gemma4", TOOLS, "required", parallel=True)
    deep = "<|tool_call>call:get_weather{a:" + "[" * 5000 + "]" * 5000 + "}<tool_call|>"
    assert use.reply(deep, cut=False) == (deep, [])
    fine = "<|tool_call>call:get_weather{a:" + "[" * 30 + "]" * 30 + "}<tool_call|>"
    assert json.loads(use.reply(fine, cut=False)[1][0]["function"]["arguments"]) == {"a": json.loads("[" * 30 + "]" * 30)}


HARMONY_ORACLE = json.loads((Path(__file__).parent.parent / "fixtures" / "chat_templates" / "gpt_oss_replies.json").read_text())


def _channels(text: str, *, keep: bool = False) -> tuple[tuple[str, str], tuple[str, str]]:
    """A gpt-oss reply's (reasoning, answer), whole and streamed three characters at a time."""
    whole = ChannelSplit(keep_reasoning=keep).feed(text, final=True)
    split = ChannelSplit(keep_reasoning=keep)
    pieces = [text[k : k + 3] for k in range(0, len(text), 3)] or [""]
    parts = [split.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return whole, ("".join(p[0] for p in parts), "".join(p[1] for p in parts))


@pytest.mark.parametrize("reply", [r for r in HARMONY_ORACLE["replies"] if r.get("raw") and "error" not in r],
                         ids=lambda r: f"{r['case']}-{r.get('seed')}")
def test_gpt_oss_replies_read_as_llama_server_reads_them(reply: dict) -> None:
    """gpt_oss_replies.json (see the fixtures' README): llama-server's reading of gpt-oss
    replies (forced, or what its grammars let a tiny random model write): the same reasoning,
    answer and calls, whole and streamed. Where edged differs, on purpose: a call where no
    tools are in use is the answer's text (llama-server drops it), and a reply cut short in a
    call's header says nothing (llama-server's unstreamed reply is the raw text, its stream
    nothing)."""
    request, message, raw = reply["request"], reply["message"], reply["raw"]
    keep = request.get("reasoning_format") == "none"
    whole, streamed = _channels(raw, keep=keep)
    assert streamed == whole
    thought, answer = whole
    assert thought == message.get("reasoning_content", "")
    tools = request.get("tools") if request.get("tool_choice") not in (None, "none") else None
    called = re.search(r"(?:^|\s)to=functions\.", raw) is not None
    if tools is None:
        if called:  # the call's text, in the form the split hands it on
            assert answer.startswith("<|channel|>commentary to=functions.") and message["content"] in ("", raw)
        else:
            assert answer == message["content"]
        return
    use = openai_tools.ToolUse("gpt_oss", msgspec.convert(tools, list[openai_tools.Tool]),
                               request["tool_choice"], True)
    content, calls = use.reply(answer, cut=reply["finish_reason"] == "length")
    expected = [(c["name"], c["arguments"]) for c in message.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
    assert streamed_calls(use, answer) == expected
    if calls or not called:
        assert (content or "") == message["content"]
    else:  # cut in the call's header
        assert (content or "") == "" and message["content"] in ("", raw)


LFM2_ORACLE = json.loads((Path(__file__).parent.parent / "fixtures" / "chat_templates" / "lfm2_replies.json").read_text())
LFM2_THINKING = {"LFM2.5-8B-A1B": ("<think>", "</think>")}  # LFM2.5-Instruct's has no opening tag


@pytest.mark.parametrize("reply", [r for r in LFM2_ORACLE["replies"] if r.get("raw") is not None and "error" not in r],
                         ids=lambda r: f"{r['template']}-{r['case']}-{r.get('seed')}")
def test_lfm2_replies_read_as_llama_server_reads_them(reply: dict) -> None:
    """lfm2_replies.json (see the fixtures' README): llama-server's reading of LFM2 / LFM2.5
    Python-style calls its grammar let a tiny random model write (markers inside strings, keys
    twice, values of other types, cuts in a name and in the arguments) and of forced replies:
    the same names, arguments text and content, whole and streamed. One difference, as for
    every syntax here: a reply cut inside a call's name is its raw text (llama-server leaves
    the call's start out)."""
    request, message = reply["request"], reply["message"]
    text = reply["raw"]
    tags = LFM2_THINKING.get(reply["template"], ("", ""))
    thought = ""
    if tags[0] and request.get("reasoning_format") != "none":
        thought, text = syntax_named("lfm2").thinking_split(tags, None).feed(text, True)
    assert thought == message.get("reasoning_content", "")
    check_reading("lfm2", text, reply, "<|tool_call_start|>")


def test_python_literals_read_into_json_as_llama_server_converts_them() -> None:
    """LFM2's values: JSON as written (spaces too), a Python string in JSON's quotes, Python's
    names as JSON's, in place; what is no JSON (a tuple) leaves the call unread."""
    use = openai_tools.ToolUse("lfm2", TOOLS, "auto", parallel=True)
    text = ("<|tool_call_start|>[get_weather(city='Pa\\'ris', days=None, when={\"a\": [1, True]}, x=\"\\u00e9\"),"
            " get_weather(city=-0)]<|tool_call_end|>")
    content, calls = use.reply(text, cut=False)
    assert content is None and [c["function"]["arguments"] for c in calls] == [
        '{"city":"Pa\'ris","days":null,"when":{"a": [1, true]},"x":"\\u00e9"}', '{"city":-0}']
    assert streamed_calls(use, text) == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert use.reply("<|tool_call_start|>[get_weather(city=(1, 2))]<|tool_call_end|>", cut=False)[1] == []


@pytest.mark.parametrize("seed", range(4))
def test_python_calls_stream_as_they_read_whole_however_cut(seed: int) -> None:
    """Seeded soups of LFM2 calls (each value of another kind: quotes of both kinds, escapes
    still arriving, names, nested values), whole and cut anywhere: the streamed arguments add up
    to the whole reading's."""
    rng = random.Random(seed)
    use = openai_tools.ToolUse("lfm2", TOOLS, "auto", parallel=True)
    values = ['"Pa,ris"', "'Pa\\'r)is'", "True", "None", "12", "-0", "[1, 'a']", "{'k': 1}", '{"a": [true, null]}',
              '"x\\"y"', "3.5e2", "'é'", '"\\u00e9"', "[None, False]", "'\\x41b'"]
    for _ in range(300):
        calls = []
        for _ in range(rng.randint(1, 3)):
            arguments = [rng.choice(("city", "days")) + "=" + rng.choice(values) for _ in range(rng.randint(0, 3))]
            calls.append(f"get_weather({', '.join(arguments)})")
        text = "<|tool_call_start|>[" + ", ".join(calls) + "]<|tool_call_end|>"
        text = text[: rng.randint(1, len(text))]
        _, whole = use.reply(text, cut=True)
        assert streamed_calls(use, text) == [(c["function"]["name"], c["function"]["arguments"]) for c in whole], text


JSON_LIST_ORACLE = json.loads((Path(__file__).parent.parent / "fixtures" / "chat_templates" / "json_list_replies.json").read_text())


@pytest.mark.parametrize("reply", [r for r in JSON_LIST_ORACLE["replies"]
                                   if r["template"] == "NVIDIA-Nemotron-Nano-v2" and r.get("raw") is not None],
                         ids=lambda r: f"{r['case']}-{r['seed']}-{r['request']['max_tokens']}")
def test_nemotron_v2_replies_read_as_llama_server_reads_them(reply: dict) -> None:
    """json_list_replies.json (see the fixtures' README): llama-server's reading of Nemotron
    Nano v2 calls its grammar let a tiny random model write (markers inside the reasoning and
    strings, whitespace around the list's brackets and commas, several `<TOOLCALL>` sections,
    cuts in a name and in the arguments) and of forced replies: the same reasoning, content,
    names and arguments text, whole and streamed. One difference, as for every syntax here: a
    reply cut inside a call's name is its raw text (llama-server leaves the call's start out)."""
    request, message = reply["request"], reply["message"]
    syntax = syntax_named("nemotron_v2")
    # The prompt ends with "<think>\n": the reply starts inside the reasoning.
    thought, text = "", reply["raw"]
    if request.get("reasoning_format") != "none":
        thought, text = syntax.thinking_split(("<think>", "</think>"), "\n").feed(text, True)
    else:
        text = "<think>\n" + text
    assert thought == message.get("reasoning_content", "")
    check_reading("nemotron_v2", text, reply, "<TOOLCALL>")


APERTUS_ORACLE = json.loads((Path(__file__).parent.parent / "fixtures" / "chat_templates" / "apertus_replies.json").read_text())


@pytest.mark.parametrize("reply", [r for r in APERTUS_ORACLE["replies"] if r.get("raw") is not None],
                         ids=lambda r: f"{r['case']}-{r['seed']}-{r['request']['max_tokens']}")
def test_apertus_replies_read_as_llama_server_reads_them(reply: dict) -> None:
    """apertus_replies.json (see the fixtures' README): llama-server's reading of Apertus calls
    (`<|tools_prefix|>[{"NAME": {...}}, ...]<|tools_suffix|>`) its grammar let a tiny random
    model write (markers inside strings, whitespace around the list's brackets, commas, keys
    and colons, text before the calls, a reply cut after each of its first tokens) and of
    forced replies, as check_reading checks them. One more difference: llama-server names a
    call once the name's characters are all there, edged once its closing quote is, so a reply
    cut just before that quote is its raw text."""
    text, expected = reply["raw"], reply["message"].get("tool_calls", [])
    if len(expected) == 1 and text.endswith('{"' + expected[0]["name"]):
        tools = msgspec.convert(reply["request"]["tools"], list[openai_tools.Tool])
        use = openai_tools.ToolUse("apertus", tools, reply["request"]["tool_choice"], True)
        assert use.reply(text, cut=True) == (text, []) and reply["finish_reason"] == "length"
        return
    check_reading("apertus", text, reply, "<|tools_prefix|>")


def test_apertus_frame_keys_each_call_by_its_tool() -> None:
    """The grammar writes one list between Apertus's markers, each call an object whose only
    key is the tool's name and whose value the tool's arguments (llama-server's frame, without
    the whitespace its grammar also allows); auto holds from `<|tools_prefix|>` on."""
    params = GenerateParams()
    openai_tools.ToolUse("apertus", TOOLS, "auto", parallel=True).constrain(params)
    frame = msgspec.to_builtins(params.tool_calls)
    assert (frame["open"], frame["separator"], frame["close"]) == ("<|tools_prefix|>[", ", ", "]<|tools_suffix|>")
    assert frame["lazy"] is True and frame.get("trigger", "") == ""
    first = json.loads(frame["call_schema"])["anyOf"][0]
    assert first == {"type": "object", "properties": {"get_weather": EMBEDDED},
                     "required": ["get_weather"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_apertus_calls_stream_as_they_read_whole_however_cut(seed: int) -> None:
    """Seeded Apertus replies (content first or not, with whitespace before it and before the
    marker, whitespace wherever llama-server's grammar allows it, several calls, arguments
    with escapes and strings that hold the markers' text), whole and cut anywhere: the
    streamed content, names and arguments add up to the whole reading's."""
    rng = random.Random(seed)
    use = openai_tools.ToolUse("apertus", TOOLS, "auto", parallel=True)
    spaces = ["", " ", "\n", "\n\n  ", "\t"]
    arguments = ['{"city": "Paris"}', '{ "city" :\n "P]a, " }', "{}", '{"city": "<|tools_suffix|>"}',
                 '{"n": [1, {"x": "}]"}], "city": "\\u00e9\\\\u12 \\""}']
    for _ in range(300):
        calls = [
            f"{{{rng.choice(spaces)}\"{rng.choice(('get_weather', 'lights_off'))}\"{rng.choice(spaces)}:"
            f"{rng.choice(spaces)}{rng.choice(arguments)}{rng.choice(spaces)}}}"
            for _ in range(rng.randint(1, 3))
        ]
        text = (rng.choice(spaces) + rng.choice(("", "Let me look. ", "x\n")) + "<|tools_prefix|>" + rng.choice(spaces)
                + "[" + rng.choice(spaces) + (rng.choice(spaces) + "," + rng.choice(spaces)).join(calls)
                + rng.choice(spaces) + "]" + rng.choice(spaces) + "<|tools_suffix|>")
        content, whole = use.reply(text, cut=False)
        assert len(whole) == len(calls) and not (content or "")[:1].isspace(), text
        text = text[: rng.randint(1, len(text))]
        content, whole = use.reply(text, cut=True)
        stream = use.stream()
        pieces = [text[k : k + 3] for k in range(0, len(text), 3)]
        deltas = [d for i, p in enumerate(pieces) for d in stream.feed(p, final=i == len(pieces) - 1)]
        assert "".join(d.get("content", "") for d in deltas) == (content or ""), text
        assert streamed_calls(use, text) == [(c["function"]["name"], c["function"]["arguments"]) for c in whole], text


R1_ORACLE = json.loads((Path(__file__).parent.parent / "fixtures" / "chat_templates" / "deepseek_r1_replies.json").read_text())
R1_CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
R1_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
R1_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"


def _r1_text(reply: dict) -> str:
    """The reply's text as edged's engine writes it. llama-server prints a control token that
    is not on its preserved list as nothing, and with the Qwen distill's template it keeps only
    the calls' and a call's opening markers: the ends it dropped go back after each call's
    closing fence (edged's frame holds all the markers, so its text has them)."""
    raw = reply["raw"]
    if reply["template"] != "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B" or R1_CALL_END in raw:
        return raw
    raw = re.sub(rf"```(?=\s*{re.escape(R1_CALL_BEGIN)})", "```" + R1_CALL_END, raw)
    if reply["finish_reason"] == "tool_calls":
        raw += R1_CALL_END + R1_CALLS_END
    return raw


@pytest.mark.parametrize("reply", [r for r in R1_ORACLE["replies"] if r.get("raw") is not None],
                         ids=lambda r: f"{r['template'][:14]}-{r['case']}-{r['seed']}-{r['request']['max_tokens']}")
def test_deepseek_r1_replies_read_as_llama_server_reads_them(reply: dict) -> None:
    """deepseek_r1_replies.json (see the fixtures' README): llama-server's reading of DeepSeek
    R1 calls its grammar let a tiny random model write (whitespace around the arguments and
    between calls, markers inside the reasoning and before the calls, several calls, cuts in a
    name and in the arguments) and of forced replies: the same reasoning, content, names and
    arguments text, whole and streamed. Two differences: a reply cut inside a call's name is
    its raw text (llama-server leaves the call's start out), as for every syntax here; a
    reasoning of only the newline after the prompt's `<think>` is that newline (llama-server
    sends none)."""
    request, message = reply["request"], reply["message"]
    syntax = syntax_named("deepseek_r1")
    text = _r1_text(reply)
    closed = request.get("chat_template_kwargs", {}).get("enable_thinking") is False
    # The prompt ends with "<think>\n" (the reply starts inside the reasoning) or, thinking off
    # with the Qwen distill's template, "<think>\n</think>".
    thought = ""
    if request.get("reasoning_format") == "none":
        text = ("<think>\n</think>" if closed else "<think>\n") + text
    elif not closed:
        thought, text = syntax.thinking_split(("<think>", "</think>"), "\n").feed(text, True)
    assert thought == (message.get("reasoning_content") or ("\n" if thought == "\n" else ""))
    check_reading("deepseek_r1", text, reply, "<\uff5ctool\u2581calls\u2581begin\uff5c>")


@pytest.mark.parametrize("seed", range(4))
def test_deepseek_r1_calls_stream_as_they_read_whole_however_cut(seed: int) -> None:
    """Seeded DeepSeek R1 replies (content first or not, whitespace wherever llama-server's
    grammar allows it, several calls, arguments with strings that hold the markers' text),
    whole and cut anywhere: the streamed names and arguments add up to the whole reading's."""
    rng = random.Random(seed)
    use = openai_tools.ToolUse("deepseek_r1", TOOLS, "auto", parallel=True)
    spaces = ["", " ", "\n", "\n\n  ", "\t"]
    arguments = ['{"city": "Paris"}', '{ "city" :\n "P```a" }', "{}", '{"city": "<\uff5ctool\u2581call\u2581end\uff5c>"}',
                 '{"n": [1, {"x": "}]"}], "city": "\\u00e9"}']
    for _ in range(300):
        calls = [
            f"{R1_CALL_BEGIN}function<\uff5ctool\u2581sep\uff5c>{rng.choice(('get_weather', 'lights_off'))}\n```json\n"
            f"{rng.choice(spaces)}{rng.choice(arguments)}{rng.choice(spaces)}```{R1_CALL_END}"
            for _ in range(rng.randint(1, 3))
        ]
        text = (rng.choice(("", "Let me look. ", "x\n")) + "<\uff5ctool\u2581calls\u2581begin\uff5c>" + rng.choice(spaces)
                + rng.choice(spaces).join(calls) + rng.choice(spaces) + R1_CALLS_END)
        whole = use.reply(text, cut=False)[1]
        assert len(whole) == len(calls), text
        text = text[: rng.randint(1, len(text))]
        _, whole = use.reply(text, cut=True)
        assert streamed_calls(use, text) == [(c["function"]["name"], c["function"]["arguments"]) for c in whole], text


MINICPM_TOOLS = msgspec.convert(
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "maybe": {"type": ["string", "null"]},
        "o": {"type": "object"}, "l": {"type": "array"}}}}},
     {"type": "function", "function": {"name": "g"}}],
    list[openai_tools.Tool],
)
MINICPM_REPLY = (
    'Let me look. \n<function name="f"> <param name="s"><![CDATA[a </param> & <b>\nc]]></param>\n'
    '<param name="i">-12</param><param name="maybe">null</param><param name="o">{"k": [1, "x"]}</param>'
    '<param name="l">[]</param><param name="s">x<y</param> </function>\n<function name="g"></function> '
)
MINICPM_CALLS = [
    ("f", '{"s":"a </param> & <b>\\nc","i":-12,"maybe":"null","o":{"k": [1, "x"]},"l":[],"s":"x<y"}'),
    ("g", "{}"),
]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_minicpm5_calls_whole_and_streamed(step: int) -> None:
    """MiniCPM5's `<function name="f"><param name="k">v</param></function>`: a string where the
    schema admits one (raw, or CDATA's text, which may hold the close), other values as JSON
    text, whitespace between the tags, a key as often as written; the content keeps the
    whitespace before the first call (as llama-server reads them)."""
    use = openai_tools.ToolUse("minicpm5", MINICPM_TOOLS, "auto", parallel=True)
    content, calls = use.reply(MINICPM_REPLY, cut=False)
    assert content == "Let me look. \n"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == MINICPM_CALLS
    stream = use.stream()
    pieces = [MINICPM_REPLY[k : k + step] for k in range(0, len(MINICPM_REPLY), step)]
    deltas = [d for i, p in enumerate(pieces) for d in stream.feed(p, final=i == len(pieces) - 1)]
    assert "".join(d.get("content", "") for d in deltas) == content
    streamed: list[list[str]] = []
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            if call["index"] == len(streamed):
                streamed.append([call["function"]["name"], ""])
            streamed[call["index"]][1] += call["function"].get("arguments", "")
    assert [tuple(c) for c in streamed] == MINICPM_CALLS


def test_minicpm5_holds_back_what_may_be_cdata_or_a_close() -> None:
    use = openai_tools.ToolUse("minicpm5", MINICPM_TOOLS, "required", parallel=True)
    stream = use.stream()
    head = stream.feed('<function name="f"><param name="s"><![CD')
    # The key once its tag is out; the string's opening quote with its first character.
    assert [d["tool_calls"][0]["function"].get("arguments") for d in head] == ["", '{"s":']
    assert stream.feed("ATA[a]]") == [{"tool_calls": [{"index": 0, "function": {"arguments": '"a'}}]}]
    assert stream.feed("></par") == []
    assert stream.feed("am>") == [{"tool_calls": [{"index": 0, "function": {"arguments": '"'}}]}]
    # Text after CDATA's end other than the close: no call (llama-server answers an error), the
    # reply is its text.
    broken = '<function name="f"><param name="s"><![CDATA[a]]>b</param></function>'
    assert use.reply(broken, cut=False) == (broken, [])
    # Free text: "<function" only once it is no longer a start of it.
    stream = use.stream()
    assert stream.feed("Hi <func") == [{"content": "Hi"}]
    assert stream.feed("k") == [{"content": " <funck"}]


MINICPM_ORACLE = json.loads(
    (Path(__file__).parent.parent / "fixtures" / "chat_templates" / "minicpm5_replies.json").read_text())


@pytest.mark.parametrize("reply", [r for r in MINICPM_ORACLE["replies"] if r.get("raw") is not None and "error" not in r],
                         ids=lambda r: f"{r['case']}-{r.get('seed')}-{r['request'].get('max_tokens')}")
def test_minicpm5_replies_read_as_llama_server_reads_them(reply: dict) -> None:
    """minicpm5_replies.json (see the fixtures' README): llama-server's reading of MiniCPM5 calls
    its grammar let a tiny random model write (markers inside values, keys twice, cuts in a name
    and in a value), of replies it continued from a given start (CDATA, whitespace, types) and
    of forced replies without tools: the same reasoning, content, names and arguments text,
    whole and streamed. One difference, as for every syntax here: a reply cut inside a call's
    name is its raw text (llama-server leaves the call's start out)."""
    request, message = reply["request"], reply["message"]
    text = reply.get("prefill", "") + reply["raw"]
    thought = ""
    thinking = request.get("chat_template_kwargs", {}).get("enable_thinking", True)
    if thinking and request.get("reasoning_format") != "none":
        # The prompt ends with "<think>\n": the reply starts inside the reasoning.
        thought, text = syntax_named("minicpm5").thinking_split(("<think>", "</think>"), "\n").feed(text, True)
    elif thinking:
        text = "<think>\n" + text  # llama-server's content then holds the reasoning, tags and all
    assert thought == message.get("reasoning_content", "")
    check_reading("minicpm5", text, reply, "<function")


@pytest.mark.parametrize("seed", range(4))
def test_minicpm5_calls_stream_as_they_read_whole_however_cut(seed: int) -> None:
    """Seeded soups of MiniCPM5 calls (raw, CDATA and JSON values, markers inside them, spaces
    between the tags), whole and cut anywhere: the streamed content and arguments add up to
    the whole reading's."""
    rng = random.Random(seed)
    use = openai_tools.ToolUse("minicpm5", MINICPM_TOOLS, "auto", parallel=True)
    values = {"s": ["Paris", "", "a<b", "<![CDATA[x</param>y]]>", "<![CDATA[]]>", "<!", "é\n", '"q"'],
              "i": ["3", "-0", "12"], "maybe": ["null", "<![CDATA[null]]>", "x"],
              "o": ['{"a": [1, "</param>"]}', "{}", '{"b": 2}x'], "l": ["[1, 2]", '["<function"]']}
    for _ in range(300):
        calls = []
        for _ in range(rng.randint(1, 3)):
            keys = [rng.choice(list(values)) for _ in range(rng.randint(0, 3))]
            space = rng.choice(["", " ", "\n"])
            body = space.join(f'<param name="{k}">{rng.choice(values[k])}</param>' for k in keys)
            calls.append(f'<function name="{rng.choice("fg")}">{space}{body}{space}</function>')
        text = rng.choice(["", "Hi ", "a<b\n"]) + "\n".join(calls)
        text = text[: rng.randint(1, len(text))]
        content, whole = use.reply(text, cut=True)
        assert streamed_calls(use, text) == [(c["function"]["name"], c["function"]["arguments"]) for c in whole], text
        stream = use.stream()
        pieces = [text[k : k + 2] for k in range(0, len(text), 2)]
        sent = "".join(d.get("content", "") for i, p in enumerate(pieces)
                       for d in stream.feed(p, final=i == len(pieces) - 1))
        assert sent == (content or ""), text


def test_minicpm5_frame() -> None:
    params = GenerateParams()
    openai_tools.ToolUse("minicpm5", MINICPM_TOOLS, "auto", parallel=True).constrain(params)
    frame = params.tool_calls
    assert frame is not None and frame.lazy and frame.max_calls is None
    assert (frame.open, frame.separator, frame.close, frame.args_marker, frame.trigger) == (
        '<function name="', '</function>\n<function name="', "</function>", '">', "<function")
    assert (frame.arguments_syntax, frame.xml_parameter, frame.xml_cdata) == (
        "xml", ('<param name="', '">', "</param>"), True)
