"""Tool calls on the llama.cpp backend, against real llama.cpp on tiny random GGUF models:
the chat template's tool syntax, prompts with tools rendered as llama-server renders them,
and the grammar that holds the output to a ToolCallFrame (eager and lazy)."""

from __future__ import annotations

import datetime
import importlib
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from gguf_builder import _vocab, write_tiny_llama

from daemon.backend import GenerateParams, ToolCallFrame
from daemon.errors import InvalidArgument

gguf = pytest.importorskip("gguf")

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
APPLY_TOOLS = json.loads((TEMPLATES / "apply_template_tools.json").read_text())

Loader = Callable[..., Awaitable[Any]]


@pytest.fixture
def load(load_llamacpp: Loader) -> Loader:
    """`await load(path, n_parallel="8", ...)`: see tests/backends/conftest.py."""
    return load_llamacpp


def token_id(path: Path, piece: str) -> int:
    reader = gguf.GGUFReader(str(path))
    field_ = reader.fields["tokenizer.ggml.tokens"]
    return [bytes(field_.parts[i]).decode() for i in field_.data].index(piece)


async def text_of(backend: Any, prompt: str, params: GenerateParams) -> tuple[str, str | None]:
    text, finish = "", None
    async for chunk in backend.generate(prompt, params):
        text += chunk.text
        finish = chunk.finish_reason
    return text, finish


# --------------------------------------------------------------------------- templates

SYNTAXES = {
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral_call_id",
    "mistralai-Ministral-3-14B-Reasoning-2512": "mistral_args",
    "unsloth-mistral-Devstral-Small-2507": "mistral_args",
    "Qwen3.5-4B": "qwen3_coder",
    "google-gemma-4-31B-it": "gemma4",
    "openai-gpt-oss-120b": "gpt_oss",
    "LFM2-8B-A1B": "lfm2",
    "LFM2.5-8B-A1B": "lfm2",
    "LFM2.5-Instruct": "lfm2",
    "openbmb-MiniCPM5-1B": "minicpm5",
    "NVIDIA-Nemotron-Nano-v2": "nemotron_v2",
    "Apertus-8B-Instruct": "apertus",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek_r1",
    "llama-cpp-deepseek-r1": "deepseek_r1",
    # It writes calls only for a `content` of None, which llama-server makes "": none.
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "",
    # Its system prompt asks for `<|tool_call|>[...]`, but it writes no past calls and
    # llama-server parses none: the generic reply.
    "ibm-granite-granite-3.3-2B-Instruct": "",
    "google-gemma-2-2b-it": "",
    "microsoft-Phi-3.5-mini-instruct": "",
}


@pytest.mark.parametrize("family", sorted(SYNTAXES))
async def test_tool_syntax_is_read_from_the_template(load: Loader, tmp_path: Path, family: str) -> None:
    template = (TEMPLATES / f"{family}.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template))
    assert backend.tool_syntax() == SYNTAXES[family]
    assert backend.engine_stats()["chat_template_tools"] == SYNTAXES[family]


# Templates that share a syntax's markers but write calls another way (XML calls without the
# newlines Qwen3-Coder writes between tags, which llama.cpp reads as another format, and a
# `[TOOL_CALLS]name(arguments)` no Mistral template writes).
XML_CALLS = (
    "{%- if tools %}<|im_start|>system\nCall tools as <tool_call><function=name>...</function>"
    "</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}\n<tool_call>\n<function={{ c.function.name }}>\n"
    "{%- for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)
PAREN_CALLS = (
    "{%- for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{% for c in m.tool_calls or [] %}[TOOL_CALLS]{{ c.function.name }}"
    "({{ c.function.arguments }}){% endfor %}{{ m.content }}</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}"
)

# DeepSeek V3.1's way: R1's markers, but the name right after the call's marker and the
# arguments right after the separator, no code block.
R1_MARKERS_V31_CALLS = (
    "{%- for m in messages %}{% if m.role == 'user' %}<\uff5cUser\uff5c>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<\uff5cAssistant\uff5c>{% for c in m.tool_calls or [] %}"
    "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>{{ c.function.name }}"
    "<\uff5ctool\u2581sep\uff5c>{{ c.function.arguments | tojson }}<\uff5ctool\u2581call\u2581end\uff5c>"
    "<\uff5ctool\u2581calls\u2581end\uff5c>{% endfor %}{{ m.content }}"
    "{% elif m.role == 'tool' %}<\uff5ctool\u2581output\u2581begin\uff5c>{{ m.content }}{% endif %}{% endfor %}"
    "<\uff5cAssistant\uff5c>"
)


@pytest.mark.parametrize("template", [XML_CALLS, PAREN_CALLS, R1_MARKERS_V31_CALLS])
async def test_markers_without_the_syntax_are_no_tool_syntax(load: Loader, tmp_path: Path, template: str) -> None:
    # Asked for Hermes JSON or Mistral Nemo's list, such a model would write calls it was
    # not trained on: the routes use the generic reply instead.
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template))
    assert backend.tool_syntax() == ""


async def test_builtin_and_chatml_templates_have_no_tool_syntax(load: Loader, tmp_path: Path) -> None:
    """Even with a Hermes-style Jinja template in the GGUF: a built-in template named in the
    config renders, and it writes no tool calls."""
    hermes = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    builtin = await load(write_tiny_llama(tmp_path / "qwen.gguf", chat_template=hermes), chat_template="chatml")
    bare = await load(write_tiny_llama(tmp_path / "bare.gguf", chat_template=None))
    call = {"id": "abc123DEF", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for backend in (builtin, bare):
        assert backend.tool_syntax() == ""
        with pytest.raises(InvalidArgument, match=r"tools: the model's chat template .* takes no tools"):
            backend.chat_prompt([{"role": "user", "content": "hi"}], tools=APPLY_TOOLS["tools"])
        with pytest.raises(InvalidArgument, match=r"messages\[1\]\.tool_calls: .* cannot represent tool calls"):
            backend.chat_prompt([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}])


@pytest.mark.parametrize("family", sorted(APPLY_TOOLS["prompts"]))
async def test_tools_render_what_llama_server_renders(load: Loader, tmp_path: Path, family: str) -> None:
    """apply_template_tools.json (see the fixtures' README): tools, a call and its result, and
    for Hermes-style templates two parallel calls, byte for byte as llama-server --jinja."""
    template = (TEMPLATES / f"{family}.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template))
    now = datetime.datetime.now()
    for case, expected in APPLY_TOOLS["prompts"][family].items():
        prompt = backend.chat_prompt(APPLY_TOOLS["cases"][case], tools=APPLY_TOOLS["tools"])
        # Templates print today's date in one of two forms; the capture keeps placeholders.
        expected = expected.replace("{date_string}", now.strftime("%d %b %Y"))
        assert prompt == expected.replace("{date_iso}", now.strftime("%Y-%m-%d")), case


XML_ORACLE = json.loads((TEMPLATES / "xml_tool_replies.json").read_text())


async def test_xml_tool_calls_render_what_llama_server_renders(load: Loader, tmp_path: Path) -> None:
    """xml_tool_replies.json's prompts (Qwen 3.5's template): tools, a call whose arguments
    hold a string, an integer, an object and a list and its result, two parallel calls, and
    with thinking off, byte for byte as llama-server's /apply-template."""
    template = (TEMPLATES / "Qwen3.5-4B.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template))
    for case, request in XML_ORACLE["prompt_requests"].items():
        prompt = backend.chat_prompt(request["messages"], tools=request["tools"],
                                     template_kwargs=request.get("chat_template_kwargs"))
        assert prompt == XML_ORACLE["prompts"][case], case


async def test_gemma4_renders_what_llama_server_renders(load: Loader, tmp_path: Path) -> None:
    """gemma4_replies.json's prompts (Gemma 4's template): tools, a system message, an agent's
    loop with arguments of each type and JSON and text results, parallel calls, reasoning on
    a turn with calls, thinking on and off, byte for byte as llama-server's /apply-template
    (which, as edged, passes enable_thinking true unless the request says otherwise)."""
    oracle = json.loads((TEMPLATES / "gemma4_replies.json").read_text())
    template = (TEMPLATES / "google-gemma-4-31B-it.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template))
    for case, request in oracle["prompt_requests"].items():
        prompt = backend.chat_prompt(request["messages"], tools=request.get("tools"),
                                     template_kwargs=request.get("chat_template_kwargs"))
        assert prompt == oracle["prompts"][case], case


async def test_gpt_oss_renders_what_llama_server_renders(load: Loader, tmp_path: Path) -> None:
    """gpt_oss_replies.json's prompts (gpt-oss's template): a system message, reasoning levels
    (as chat_template_kwargs and as OpenAI's top-level reasoning_effort), tools, a call with its
    reasoning and its result (the reasoning as the template's `thinking`), and an earlier
    answer whose reasoning the template drops, byte for byte as llama-server's /apply-template."""
    oracle = json.loads((TEMPLATES / "gpt_oss_replies.json").read_text())
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=(TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()))
    assert backend.thinking_tags() == ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant")
    today = datetime.datetime.now().strftime("%Y-%m-%d")
    for case, request in oracle["prompt_requests"].items():
        kwargs = request.get("chat_template_kwargs") or {}
        if "reasoning_effort" in request:
            kwargs = {**kwargs, "reasoning_effort": request["reasoning_effort"]}
        prompt = backend.chat_prompt(request["messages"], tools=request.get("tools"), template_kwargs=kwargs or None)
        assert prompt == oracle["prompts"][case].replace("{date_string}", today), case
    two = {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    loop = oracle["prompt_requests"]["tool_loop"]["messages"]
    parallel = [*loop[:1], {**loop[1], "tool_calls": [*loop[1]["tool_calls"], two]}]
    with pytest.raises(InvalidArgument, match=r"messages\[1\]\.tool_calls: .* one call per assistant message"):
        backend.chat_prompt(parallel, tools=oracle["tools"])


@pytest.mark.parametrize("family", ["LFM2-8B-A1B", "LFM2.5-8B-A1B", "LFM2.5-Instruct"])
async def test_lfm2_renders_what_llama_server_renders(load: Loader, tmp_path: Path, family: str) -> None:
    """lfm2_replies.json's prompts (Liquid's templates): tools, a system message, a call and
    two parallel calls with their results (LFM2.5-8B-A1B writes them back as Python-style calls
    from their arguments as objects, the others leave them out), byte for byte as llama-server's
    /apply-template."""
    oracle = json.loads((TEMPLATES / "lfm2_replies.json").read_text())
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=(TEMPLATES / f"{family}.jinja").read_text()))
    assert backend.tool_syntax() == "lfm2"
    for case, request in oracle["prompt_requests"].items():
        prompt = backend.chat_prompt(request["messages"], tools=request.get("tools"))
        assert prompt == oracle["prompts"][f"{family}/{case}"], case


@pytest.mark.parametrize(
    "family",
    ["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "llama-cpp-deepseek-r1", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B"],
)
async def test_deepseek_r1_renders_what_llama_server_renders(load: Loader, tmp_path: Path, family: str) -> None:
    """deepseek_r1_replies.json's prompts (DeepSeek R1's templates): tools (llama.cpp's own
    template lists them with `tools | map(attribute='function') | tojson(indent=2)`, a lazy
    `map` result), a call and two parallel calls with their results (arguments as objects
    where the template writes them with tojson; the Llama distill's drops a call whose content
    is "", as llama-server hands it), an answered loop, a system message, thinking off; byte
    for byte as llama-server's /apply-template."""
    oracle = json.loads((TEMPLATES / "deepseek_r1_replies.json").read_text())
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=(TEMPLATES / f"{family}.jinja").read_text()))
    for case, request in oracle["prompt_requests"].items():
        prompt = backend.chat_prompt(
            request["messages"], template_kwargs=request.get("chat_template_kwargs"), tools=request.get("tools")
        )
        assert prompt == oracle["prompts"][f"{family}/{case}"], case


@pytest.mark.parametrize("family", ["NVIDIA-Nemotron-Nano-v2", "ibm-granite-granite-3.3-2B-Instruct"])
async def test_json_list_templates_render_what_llama_server_renders(load: Loader, tmp_path: Path, family: str) -> None:
    """json_list_replies.json's prompts: a user turn (also `/no_think`, which closes Nemotron's
    reasoning), tools, a system message with tools, a call and two parallel calls with their
    results (Nemotron writes them back as one `<TOOLCALL>[...]` list from their arguments as
    objects; Granite 3.3 leaves them out), byte for byte as llama-server's /apply-template."""
    oracle = json.loads((TEMPLATES / "json_list_replies.json").read_text())
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=(TEMPLATES / f"{family}.jinja").read_text()))
    assert backend.tool_syntax() == SYNTAXES[family]
    today = datetime.date.today().strftime("%B %d, %Y")
    for case, request in oracle["prompt_requests"].items():
        prompt = backend.chat_prompt(request["messages"], tools=request.get("tools"))
        assert prompt == oracle["prompts"][f"{family}/{case}"].replace("{today}", today), case


# Where edged renders MiniCPM5's history on purpose otherwise than llama-server: the template
# prints a value as it is, and llama-server's Jinja prints an object and null as nothing and
# runs a list's items together; edged gives the template their JSON text, as the model writes them.
MINICPM5_DIFFERENCES = {
    "loop": ('<param name="filters"></param><param name="tags">cheapquiet</param>',
             '<param name="filters">{"stars": 4}</param><param name="tags">["cheap", "quiet"]</param>'),
    "values": ('<param name="query"></param><param name="filters"></param><param name="tags"></param>',
               '<param name="query">null</param><param name="filters">{"a": [1, "x"], "b": false}</param>'
               '<param name="tags">[]</param>'),
}
MINICPM5_DIFFERENCES["loop_no_thinking"] = MINICPM5_DIFFERENCES["loop"]


async def test_minicpm5_renders_what_llama_server_renders(load: Loader, tmp_path: Path) -> None:
    """minicpm5_replies.json's prompts (MiniCPM5's template): tools after a system message or
    alone, a call with a CDATA value and its result, two parallel calls and results, a call
    after content and reasoning, booleans, numbers and strings in calls, thinking on and off,
    byte for byte as llama-server's /apply-template; objects, lists and null as their JSON
    text (MINICPM5_DIFFERENCES)."""
    oracle = json.loads((TEMPLATES / "minicpm5_replies.json").read_text())
    template = (TEMPLATES / "openbmb-MiniCPM5-1B.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template))
    assert backend.tool_syntax() == "minicpm5"
    for case, request in oracle["prompt_requests"].items():
        prompt = backend.chat_prompt(request["messages"], template_kwargs=request.get("chat_template_kwargs"),
                                     tools=request.get("tools"))
        theirs, ours = MINICPM5_DIFFERENCES.get(case, ("", ""))
        assert theirs in oracle["prompts"][case]
        assert prompt == oracle["prompts"][case].replace(theirs, ours), case


async def test_apertus_renders_what_llama_server_renders(load: Loader, tmp_path: Path) -> None:
    """apertus_replies.json's prompts: a user turn, tools (also with `enable_thinking`, which
    turns on its "Deliberation"), a system message with tools, a call and its result, an
    answer after it, two parallel calls with text and their results (written back as one
    `<|tools_prefix|>[{"NAME": {...}}, ...]<|tools_suffix|>` list from their arguments as
    objects, the results as one list), byte for byte as llama-server's /apply-template."""
    oracle = json.loads((TEMPLATES / "apertus_replies.json").read_text())
    template = (TEMPLATES / "Apertus-8B-Instruct.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template))
    assert backend.tool_syntax() == "apertus"
    today = datetime.date.today().strftime("%Y-%m-%d")
    for case, request in oracle["prompt_requests"].items():
        prompt = backend.chat_prompt(request["messages"], template_kwargs=request.get("chat_template_kwargs"),
                                     tools=request.get("tools"))
        assert prompt == oracle["prompts"][case].replace("{today}", today), case


async def test_tool_call_arguments_are_objects_where_the_template_reads_them_so(load: Loader, tmp_path: Path) -> None:
    """Qwen writes `arguments | tojson`: JSON text is parsed (and written back in tojson's
    spacing, as llama-server does); a template that prints the text gets it verbatim."""
    qwen = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    objects = await load(write_tiny_llama(tmp_path / "qwen.gguf", chat_template=qwen))
    text = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}<{{ c.function.arguments }}>{% endfor %}{% endfor %}"
    verbatim = await load(write_tiny_llama(tmp_path / "text.gguf", chat_template=text))
    call = {"id": "abc123DEF", "type": "function", "function": {"name": "f", "arguments": '{"city":"Paris" , "n":[1,2]}'}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert '{"name": "f", "arguments": {"city": "Paris", "n": [1, 2]}}' in objects.chat_prompt(messages)
    assert verbatim.chat_prompt(messages) == '[user]hi[assistant]<{"city":"Paris" , "n":[1,2]}>'
    broken = {**call, "function": {"name": "f", "arguments": "{city: Paris}"}}
    with pytest.raises(InvalidArgument, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"):
        objects.chat_prompt([messages[0], {"role": "assistant", "content": None, "tool_calls": [broken]}])
    assert verbatim.chat_prompt([messages[0], {"role": "assistant", "content": None, "tool_calls": [broken]}]).endswith(
        "<{city: Paris}>"
    )


# --------------------------------------------------------------------------- tool-call grammar

WEATHER_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
HERMES = {"open": "<tool_call>\n", "separator": "\n</tool_call>\n<tool_call>\n", "close": "\n</tool_call>"}
PROMPT = "What is the weather in Paris?"


def check_call(text: str) -> None:
    call = json.loads(text)  # strict: a control character in a string is escaped, as JSON has it
    assert call["name"] == "get_weather"
    assert set(call["arguments"]) == {"city"} and isinstance(call["arguments"]["city"], str)
    assert len(call["arguments"]["city"]) <= 8


def frame_calls(text: str, frame: ToolCallFrame) -> list[str]:
    """The calls' JSON texts of `text`, which must be exactly one frame: each call read as a
    JSON value (a string in it may hold the separator), then the separator or the close."""
    assert text.startswith(frame.open) and text.endswith(frame.close), text
    calls, at, decoder = [], len(frame.open), json.JSONDecoder()
    while True:
        _, end = decoder.raw_decode(text, at)
        calls.append(text[at:end])
        if text[end:] == frame.close:
            return calls
        assert frame.separator and text.startswith(frame.separator, end), text
        at = end + len(frame.separator)


@pytest.mark.parametrize("max_calls", [1, 2])
async def test_tool_call_frame_holds_the_output(load: Loader, tmp_path: Path, max_calls: int) -> None:
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    frame = ToolCallFrame(call_schema=json.dumps(WEATHER_CALL), max_calls=max_calls, **HERMES)
    counts = set()
    # Enough seeds to see both counts whatever this CPU's arithmetic samples (6 do here); the
    # loop ends once both are seen.
    for seed in range(40):
        if seed >= 6 and (max_calls == 1 or counts == {1, 2}):
            break
        params = GenerateParams(temperature=1.0, seed=seed, max_tokens=200, tool_calls=frame)
        text, finish = await text_of(backend, PROMPT, params)
        assert finish == "stop", text  # the frame complete, only end-of-generation was left
        calls = frame_calls(text, frame)
        assert 1 <= len(calls) <= max_calls
        counts.add(len(calls))
        for call in calls:
            check_call(call)
    if max_calls == 2:
        assert counts == {1, 2}, "the seeds should show both one and two calls"


async def test_mistral_shaped_frame(load: Loader, tmp_path: Path) -> None:
    schema = json.loads(json.dumps(WEATHER_CALL))
    schema["properties"]["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
    schema["required"].append("id")
    frame = ToolCallFrame(call_schema=json.dumps(schema), open="[TOOL_CALLS][", separator=", ", close="]", max_calls=2)
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    for seed in range(4):
        params = GenerateParams(temperature=1.0, seed=seed, max_tokens=230, tool_calls=frame)
        text, finish = await text_of(backend, PROMPT, params)
        assert finish == "stop" and text.startswith("[TOOL_CALLS]["), text
        calls = json.loads(text[len("[TOOL_CALLS]") :], strict=False)
        assert 1 <= len(calls) <= 2
        for call in calls:
            assert len(call.pop("id")) == 9
            check_call(json.dumps(call))


@pytest.mark.parametrize("id_marker", ["", "[CALL_ID]"])
async def test_named_calls_frame(load: Loader, tmp_path: Path, id_marker: str) -> None:
    """Newer Mistral templates' calls, `[TOOL_CALLS]name[ARGS]{...}` one after another (with
    `[CALL_ID]` and a 9-character id after the name for Mistral Small 3.2), the markers control
    tokens as in Mistral's vocabulary: they keep their text, eager and lazy."""
    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    path = write_tiny_llama(tmp_path / "model.gguf", control_tokens=markers)
    backend = await load(path)
    arguments = WEATHER_CALL["properties"]["arguments"]
    named = {"get_weather": json.dumps(arguments), "lights_off": json.dumps({"type": "object", "properties": {}, "additionalProperties": False})}
    frame = ToolCallFrame(open="[TOOL_CALLS]", separator="[TOOL_CALLS]", named_calls=named, args_marker="[ARGS]",
                          id_marker=id_marker, max_calls=2)
    pattern = re.compile(r"\[TOOL_CALLS\](get_weather|lights_off)" + (r"\[CALL_ID\][a-zA-Z0-9]{9}" if id_marker else "")
                         + r"\[ARGS\](\{.*?\})\s?(?=\[TOOL_CALLS\]|$)", re.DOTALL)
    for seed in range(4):
        params = GenerateParams(temperature=1.0, seed=seed, max_tokens=200, tool_calls=frame)
        text, finish = await text_of(backend, PROMPT, params)
        assert finish == "stop", text
        calls = pattern.findall(text)
        assert 1 <= len(calls) <= 2 and "".join(m.group(0) for m in pattern.finditer(text)) == text, text
        for name, args in calls:
            value = json.loads(args, strict=False)
            if name == "get_weather":
                check_call(json.dumps({"name": name, "arguments": value}))
            else:
                assert value == {}
    # Lazy: triggered by the marker token alone (pushed by a bias), the rest follows.
    marker = len(_vocab()[0])
    lazy = msgspec.structs.replace(frame, lazy=True, max_calls=1)
    params = GenerateParams(temperature=0, max_tokens=200, tool_calls=lazy, logit_bias={marker: 100.0})
    text, finish = await text_of(backend, PROMPT, params)
    assert finish == "stop" and len(pattern.findall(text)) == 1 and text.startswith("[TOOL_CALLS]"), text


XML = {"open": "<tool_call>\n<function=", "separator": "</function>\n</tool_call>\n<tool_call>\n<function=",
       "close": "</function>\n</tool_call>", "args_marker": ">\n", "arguments_syntax": "xml"}
SET_LIGHT = {
    "type": "object",
    "properties": {
        "room": {"type": "string", "enum": ["hall", "attic"]},
        "on": {"type": "boolean"},
        "level": {"type": "integer"},
        "color": {"$ref": "#/$defs/rgb"},
    },
    "required": ["room", "on"],
    "$defs": {"rgb": {"type": "object", "properties": {"r": {"type": "integer"}}, "required": ["r"],
                      "additionalProperties": False}},
}
XML_CALL = re.compile(r"<tool_call>\n<function=(\w+)>\n((?:<parameter=\w+>\n.*?\n</parameter>\n)*)</function>\n</tool_call>",
                      re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=(\w+)>\n(.*?)\n</parameter>\n", re.DOTALL)


def xml_calls(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """(name, [(key, value text)]) of each call of `text`, which must be calls and nothing else."""
    found = list(XML_CALL.finditer(text))
    assert found and "\n".join(m.group(0) for m in found) == text, text
    calls = []
    for match in found:
        parameters = XML_PARAMETER.findall(match.group(2))
        assert "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters) == match.group(2)
        calls.append((match.group(1), parameters))
    return calls


async def test_xml_arguments_frame(load: Loader, tmp_path: Path) -> None:
    """Qwen 3.5 / Qwen3-Coder calls: each value as its type is written (an enum's texts, JSON
    for the rest), the required parameters in either order, then optional ones; a tool
    without parameters has none. Eager, then lazy from the `<tool_call>` token on."""
    path = write_tiny_llama(tmp_path / "model.gguf", n_ctx=2048, user_tokens=("<tool_call>", "</tool_call>"))
    backend = await load(path)
    empty = json.dumps({"type": "object", "properties": {}})
    frame = ToolCallFrame(named_calls={"set_light": json.dumps(SET_LIGHT), "lights_off": empty}, max_calls=2, **XML)
    names, orders = set(), set()
    # A bias towards "s" or "l" picks the tool, one towards "o" or "r" after "<parameter=" the
    # order of the required two.
    biases = [{token_id(path, a): 20.0, token_id(path, b): 20.0} for a, b in (("s", "o"), ("s", "r"), ("l", "o"))]
    for seed in range(12):
        bias = biases[seed % 3]
        params = GenerateParams(temperature=1.0, seed=seed, max_tokens=1000, tool_calls=frame, logit_bias=bias)
        text, finish = await text_of(backend, PROMPT, params)
        assert finish == "stop", text
        calls = xml_calls(text)
        assert 1 <= len(calls) <= 2
        for name, parameters in calls:
            names.add(name)
            keys = [key for key, _ in parameters]
            values = dict(parameters)
            if name == "lights_off":
                assert keys == []
                continue
            assert sorted(keys[:2]) == ["on", "room"] and set(keys[2:]) <= {"level", "color"}, keys
            orders.add(tuple(keys[:2]))
            assert values["room"] in ("hall", "attic") and json.loads(values["on"]) in (True, False)
            assert isinstance(json.loads(values.get("level", "0")), int)
            assert set(json.loads(values.get("color", '{"r": 0}'))) == {"r"}
    assert names == {"set_light", "lights_off"}, "the seeds should call both tools"
    assert len(orders) == 2, "the biases should show the required parameters in both orders"
    lazy = msgspec.structs.replace(frame, lazy=True, max_calls=1)
    marker = len(_vocab()[0])
    for seed in range(3):
        params = GenerateParams(temperature=1.0, seed=seed, max_tokens=1000, tool_calls=lazy, logit_bias={marker: 100.0})
        text, finish = await text_of(backend, PROMPT, params)
        assert finish == "stop" and len(xml_calls(text)) == 1, text


GEMMA = {"open": "<|tool_call>call:", "separator": "<tool_call|><|tool_call>call:", "close": "<tool_call|>",
         "arguments_syntax": "gemma"}
GEMMA_TOKENS = ("<|tool_call>", "<tool_call|>", '<|"|>')


async def test_gemma_arguments_frame(load: Loader, tmp_path: Path) -> None:
    """Gemma 4's calls, `<|tool_call>call:name{key:value,...}<tool_call|>` one after another,
    their objects held to each tool's schema as the JSON converter holds JSON: the required
    keys in either order, optional ones at most once, each value of its type (an enum's
    texts between Gemma's string marks, a $ref's object), a tool without parameters `{}`."""
    from daemon.api import openai_tools

    path = write_tiny_llama(tmp_path / "model.gguf", n_ctx=2048, user_tokens=GEMMA_TOKENS)
    backend = await load(path)
    empty = json.dumps({"type": "object", "properties": {}})
    frame = ToolCallFrame(named_calls={"set_light": json.dumps(SET_LIGHT), "lights_off": empty}, max_calls=2, **GEMMA)
    tools = msgspec.convert([{"type": "function", "function": {"name": "set_light", "parameters": SET_LIGHT}},
                             {"type": "function", "function": {"name": "lights_off"}}], list[openai_tools.Tool])
    use = openai_tools.ToolUse("gemma4", tools, "required", parallel=True)
    names, orders = set(), set()
    biases = [{token_id(path, a): 20.0, token_id(path, b): 20.0} for a, b in (("s", "o"), ("s", "r"), ("l", "o"))]
    for seed in range(12):
        params = GenerateParams(temperature=1.0, seed=seed, max_tokens=1000, tool_calls=frame, logit_bias=biases[seed % 3])
        text, finish = await text_of(backend, PROMPT, params)
        assert finish == "stop", text
        content, calls = use.reply(text, cut=False)
        assert content is None and 1 <= len(calls) <= 2, text
        for call in calls:
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            names.add(name)
            value = json.loads(arguments)  # also: no key twice, as a JSON object reads it back
            assert arguments.count('":') == len(value) + sum(len(v) for v in value.values() if isinstance(v, dict))
            if name == "lights_off":
                assert value == {}
                continue
            keys = list(value)
            assert sorted(keys[:2]) == ["on", "room"] and set(keys[2:]) <= {"level", "color"}, keys
            orders.add(tuple(keys[:2]))
            assert value["room"] in ("hall", "attic") and isinstance(value["on"], bool)
            assert isinstance(value.get("level", 0), int) and not isinstance(value.get("level", 0), bool)
            assert set(value.get("color", {"r": 0})) == {"r"} and isinstance(value.get("color", {"r": 0})["r"], int)
    assert names == {"set_light", "lights_off"}, "the biases should call both tools"
    assert len(orders) == 2, "the biases should show the required keys in both orders"
    lazy = msgspec.structs.replace(frame, lazy=True, max_calls=1)
    marker = len(_vocab()[0])
    params = GenerateParams(temperature=1.0, seed=1, max_tokens=1000, tool_calls=lazy, logit_bias={marker: 100.0})
    text, finish = await text_of(backend, PROMPT, params)
    assert finish == "stop" and len(use.reply(text, cut=False)[1]) == 1, text


@pytest.mark.parametrize("text, accepted", [
    ("Paris\n</parameter>\n", True),
    ("\n</parameter>\n", True),  # an empty value
    ("two\nlines </parameter> <parameter\n\n</parameter>\n", True),
    ("a\n</param\n</parameter>\n", True),  # a false start, then the close
    ("Paris\n</parameter>\nmore", False),  # the first close ends the value
])
async def test_xml_string_value_runs_to_the_first_close(load: Loader, tmp_path: Path, text: str, accepted: bool) -> None:
    """A raw-text value is any text up to the first `\n</parameter>\n` (llama.cpp's grammar
    sampler itself tells which bytes it accepts)."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    frame = ToolCallFrame(named_calls={"f": json.dumps({"type": "object", "properties": {"s": {"type": "string"}},
                                                        "required": ["s"]})}, **XML)
    # The plugin's grammar module, under the private package the registry imported it as.
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    head = "<tool_call>\n<function=f>\n<parameter=s>\n"
    whole = head + text + ("" if not accepted else "</function>\n</tool_call>")
    count = backend._engine._grammar_accepts(grammar.tool_call_grammar(frame), whole)
    assert (count == len(whole.encode())) is accepted
    if not accepted:
        assert count == len((head + text).encode()) - len("more")


MINICPM5 = {"open": '<function name="', "separator": '</function>\n<function name="', "close": "</function>",
            "args_marker": '">', "arguments_syntax": "xml", "xml_parameter": ('<param name="', '">', "</param>"),
            "xml_cdata": True}
MINICPM5_TOKENS = ("<function", "</function>", "<param", "</param>", "<![CDATA[", "]]>")


async def test_minicpm5_arguments_frame(load: Loader, tmp_path: Path) -> None:
    """MiniCPM5's calls, `<function name="f"><param name="k">v</param></function>`: each value
    of its type (a string raw without "<", an enum's texts, JSON for the rest), the
    required parameters in either order, then optional ones; eager, then lazy from
    `<function` on. Read back by the syntax's reader."""
    from daemon.api import openai_tools

    path = write_tiny_llama(tmp_path / "model.gguf", n_ctx=2048, user_tokens=MINICPM5_TOKENS)
    backend = await load(path)
    schema = {**SET_LIGHT, "properties": {**SET_LIGHT["properties"], "note": {"type": "string"}}}
    empty = json.dumps({"type": "object", "properties": {}})
    frame = ToolCallFrame(named_calls={"set_light": json.dumps(schema), "lights_off": empty}, max_calls=2, **MINICPM5)
    tools = msgspec.convert([{"type": "function", "function": {"name": "set_light", "parameters": schema}},
                             {"type": "function", "function": {"name": "lights_off"}}], list[openai_tools.Tool])
    use = openai_tools.ToolUse("minicpm5", tools, "required", parallel=True)
    token = {t: len(_vocab()[0]) + i for i, t in enumerate(MINICPM5_TOKENS)}
    names, orders, notes = set(), set(), set()
    biases = [{token_id(path, a): 20.0, token_id(path, b): 20.0} for a, b in (("s", "o"), ("s", "r"), ("l", "o"))]
    for seed in range(12):
        # Values end soon, optional parameters follow, the note mostly, in raw text (a bias that
        # opened CDATA would keep it open: test_minicpm5_string_value_is_raw_or_cdata has CDATA).
        bias = {**biases[seed % 3], token["<param"]: 40.0, token_id(path, "n"): 22.0, token["</param>"]: 25.0,
                token["<![CDATA["]: -100.0, token["]]>"]: 28.0}
        params = GenerateParams(temperature=1.0, seed=seed, max_tokens=1000, tool_calls=frame, logit_bias=bias)
        text, finish = await text_of(backend, PROMPT, params)
        assert finish == "stop", text
        content, calls = use.reply(text, cut=False)
        assert content is None and 1 <= len(calls) <= 2, text
        for call in calls:
            name, value = call["function"]["name"], json.loads(call["function"]["arguments"])
            names.add(name)
            if name == "lights_off":
                assert value == {}
                continue
            keys = list(value)
            assert sorted(keys[:2]) == ["on", "room"] and set(keys[2:]) <= {"level", "color", "note"}, keys
            orders.add(tuple(keys[:2]))
            assert value["room"] in ("hall", "attic") and isinstance(value["on"], bool)
            assert isinstance(value.get("level", 0), int) and set(value.get("color", {"r": 0})) == {"r"}
            if "note" in value:
                notes.add(value["note"])
    assert names == {"set_light", "lights_off"}, "the biases should call both tools"
    assert len(orders) == 2, "the biases should show the required parameters in both orders"
    assert notes and all("<" not in note for note in notes), notes
    lazy = msgspec.structs.replace(frame, lazy=True, max_calls=1, trigger="<function")
    for seed in range(3):
        bias = {token["<function"]: 100.0, token["</param>"]: 25.0, token["<![CDATA["]: -100.0}
        params = GenerateParams(temperature=1.0, seed=seed, max_tokens=1000, tool_calls=lazy, logit_bias=bias)
        text, finish = await text_of(backend, PROMPT, params)
        assert finish == "stop" and len(use.reply(text, cut=False)[1]) == 1, text


@pytest.mark.parametrize("text, accepted", [
    ("Paris</param>", True),
    ("</param>", True),  # an empty value
    ("<![CDATA[a </param> <b>\n]]></param>", True),
    ("<![CDATA[]]></param>", True),
    ("a<b</param>", False),  # raw text holds no "<" (it could begin CDATA)
    ("<![CDATA[a]]>b</param>", False),  # CDATA's end, then only the close
])
async def test_minicpm5_string_value_is_raw_or_cdata(load: Loader, tmp_path: Path, text: str, accepted: bool) -> None:
    """A MiniCPM5 string value is text without "<" or CDATA, then `</param>` (llama.cpp's grammar
    sampler itself tells which bytes it accepts)."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    frame = ToolCallFrame(named_calls={"f": json.dumps({"type": "object", "properties": {"s": {"type": "string"}},
                                                        "required": ["s"]})}, **MINICPM5)
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    whole = '<function name="f"><param name="s">' + text + "</function>"
    count = backend._engine._grammar_accepts(grammar.tool_call_grammar(frame), whole)
    assert (count == len(whole.encode())) is accepted, count


async def test_lazy_frame_holds_from_its_open_on(load: Loader, tmp_path: Path) -> None:
    """The model is pushed to write the open ("@", one token of the tiny vocabulary) by a
    logit bias; everything from it on is a complete frame, and the output ends there."""
    path = write_tiny_llama(tmp_path / "model.gguf")
    backend = await load(path)
    at = token_id(path, "@")
    frame = ToolCallFrame(call_schema=json.dumps(WEATHER_CALL), open="@", separator=";", close="#", max_calls=2, lazy=True)
    for seed in range(4):
        params = GenerateParams(temperature=1.0, seed=seed, max_tokens=200, tool_calls=frame, logit_bias={at: 30.0})
        text, finish = await text_of(backend, PROMPT, params)
        start = text.index("@")
        assert finish == "stop", text
        for call in frame_calls(text[start:], frame):
            check_call(call)
    # An empty open: the frame starts at a leading "{" (pushed the same way).
    brace = token_id(path, "{")
    bare = ToolCallFrame(call_schema=json.dumps(WEATHER_CALL), lazy=True, max_calls=1)
    for seed in range(3):
        params = GenerateParams(temperature=1.0, seed=seed, max_tokens=200, tool_calls=bare, logit_bias={brace: 30.0})
        text, finish = await text_of(backend, PROMPT, params)
        assert finish == "stop", text
        check_call(text)
    # Until its open the lazy grammar masks nothing: never reached, the same seed writes the
    # same text as with no grammar at all.
    frame = ToolCallFrame(call_schema=json.dumps(WEATHER_CALL), lazy=True, **HERMES)
    for seed in range(4):
        free = GenerateParams(temperature=1.0, seed=seed, max_tokens=40)
        lazy = GenerateParams(temperature=1.0, seed=seed, max_tokens=40, tool_calls=frame)
        expected = await text_of(backend, PROMPT, free)
        assert "<tool_call>" not in expected[0]
        assert await text_of(backend, PROMPT, lazy) == expected


async def test_tool_call_frame_errors(load: Loader, tmp_path: Path) -> None:
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    frame = ToolCallFrame(call_schema=json.dumps(WEATHER_CALL), **HERMES)
    with pytest.raises(InvalidArgument, match="tool_calls cannot be used together with grammar"):
        await text_of(backend, PROMPT, GenerateParams(tool_calls=frame, grammar='root ::= "x"'))
    # An answer beside the calls only where the first token may begin either (not lazy).
    lazy = msgspec.structs.replace(frame, lazy=True)
    with pytest.raises(InvalidArgument, match="json_schema: with tool_calls only for a frame that is not lazy"):
        await text_of(backend, PROMPT, GenerateParams(tool_calls=lazy, json_schema='{"type": "object"}'))
    bad = ToolCallFrame(call_schema=json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}))
    with pytest.raises(InvalidArgument, match=r"tools\.properties\.n: keyword 'minimum' is not supported"):
        await text_of(backend, PROMPT, GenerateParams(tool_calls=bad))
    with pytest.raises(InvalidArgument, match=r"tool_calls\.max_calls must be >= 1"):
        await text_of(backend, PROMPT, GenerateParams(tool_calls=ToolCallFrame(call_schema="{}", max_calls=0)))
    # Once the frame is complete only end-of-generation is left, which ignore_eos bans (llama.cpp
    # aborted the process on that before); a plain grammar alike.
    for other in ({"tool_calls": frame}, {"grammar": 'root ::= "x"'}):
        with pytest.raises(InvalidArgument, match="ignore_eos cannot be used together with grammar"):
            await text_of(backend, PROMPT, GenerateParams(ignore_eos=True, **other))
    # A parameter whose schema is `true` takes any raw text.
    anything = ToolCallFrame(named_calls={"f": json.dumps({"type": "object", "properties": {"p": True}, "required": ["p"]})},
                             **XML)
    text, _ = await text_of(backend, PROMPT, GenerateParams(tool_calls=anything, max_tokens=60, temperature=0))
    assert text.startswith("<tool_call>\n<function=f>\n<parameter=p>\n"), text
    # What raw text cannot hold, in XML arguments: a string's pattern, a mixed value's enum.
    for schema, keyword in (({"type": "string", "pattern": "^a"}, "pattern"), ({"type": ["string", "null"], "enum": ["a", None]}, "enum")):
        xml = ToolCallFrame(named_calls={"f": json.dumps({"type": "object", "properties": {"p": schema}})}, **XML)
        with pytest.raises(InvalidArgument, match=rf"tools\[f\]\.parameters\.properties\.p: keyword '{keyword}' cannot be enforced"):
            await text_of(backend, PROMPT, GenerateParams(tool_calls=xml))
    for schema, keyword in (({"type": "string", "pattern": "^a"}, "pattern"), ({"type": "integer", "minimum": 1}, "minimum")):
        gemma = ToolCallFrame(named_calls={"f": json.dumps({"type": "object", "properties": {"p": schema}})}, **GEMMA)
        with pytest.raises(InvalidArgument, match=rf"tools\[f\]\.parameters\.properties\.p: keyword '{keyword}'"):
            await text_of(backend, PROMPT, GenerateParams(tool_calls=gemma))
    string_calls = ToolCallFrame(call_schema='{"type": "string"}', lazy=True)
    with pytest.raises(InvalidArgument, match="with an empty open, each call must be a JSON object"):
        await text_of(backend, PROMPT, GenerateParams(tool_calls=string_calls))


# --------------------------------------------------------------------------- calls or an answer

# A tool's and the answer's schemas both define `$defs/x`, differently: each must keep its own.
TOOL_X = {"type": "object", "properties": {"v": {"$ref": "#/$defs/x"}}, "required": ["v"],
          "additionalProperties": False, "$defs": {"x": {"type": "string", "enum": ["s"]}}}
ANSWER_X = {"type": "object", "properties": {"v": {"$ref": "#/$defs/x"}}, "required": ["v"],
            "additionalProperties": False, "$defs": {"x": {"type": "integer"}}}
ANSWERED_FRAMES = {
    # Hermes / Qwen: JSON call objects.
    "json": (ToolCallFrame(call_schema=json.dumps({
        "type": "object", "properties": {"name": {"const": "f"}, "arguments": {
            "type": "object", "properties": {"v": {"enum": ["s"]}}, "required": ["v"]}},
        "required": ["name", "arguments"], "additionalProperties": False}),
        open="<tool_call>\n", separator="\n</tool_call>\n<tool_call>\n", close="\n</tool_call>"),
        '<tool_call>\n{"name": "f", "arguments": {"v": "s"}}\n</tool_call>'),
    # Newer Mistral: a name, then its JSON arguments.
    "named": (ToolCallFrame(named_calls={"f": json.dumps(TOOL_X)}, open="[TOOL_CALLS]", separator="[TOOL_CALLS]",
                            args_marker="[ARGS]"), '[TOOL_CALLS]f[ARGS]{"v": "s"}'),
    # Qwen 3.5's XML parameters, a JSON value among them.
    "xml": (ToolCallFrame(named_calls={"f": json.dumps({
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})}, **XML),
        "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"),
    # Gemma 4's own object syntax (no JSON converter of its own).
    "gemma": (ToolCallFrame(named_calls={"f": json.dumps({"type": "object", "properties": {"v": {"type": "string"}}})},
                            open="<|tool_call>call:", separator="<tool_call|><|tool_call>call:", close="<tool_call|>",
                            arguments_syntax="gemma"), '<|tool_call>call:f{v:<|"|>s<|"|>}<tool_call|>'),
}


@pytest.mark.parametrize("kind", list(ANSWERED_FRAMES))
async def test_a_frame_with_an_answer_takes_either(load: Loader, tmp_path: Path, kind: str) -> None:
    """GenerateParams.json_schema beside a frame that is not lazy: llama.cpp's grammar sampler
    takes the whole calls or the whole answer (after its header), and neither's `$defs` the
    other's."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    frame, calls = ANSWERED_FRAMES[kind]
    text = grammar.tool_call_grammar(frame, json.dumps(ANSWER_X), "<|answer|>")
    for whole, accepted in [(calls, True), ('<|answer|>{"v": 3}', True), ('<|answer|>{"v": "s"}', False),
                            ('{"v": 3}', False), (calls.replace('"s"', "3").replace("<|\"|>s<|\"|>", "3"), kind == "xml")]:
        count = backend._engine._grammar_accepts(text, whole)
        assert (count == len(whole.encode())) is accepted, (whole, count)
    with pytest.raises(InvalidArgument, match="json_schema: with tool_calls only for a frame that is not lazy"):
        grammar.tool_call_grammar(msgspec.structs.replace(frame, lazy=True), json.dumps(ANSWER_X))
    with pytest.raises(InvalidArgument, match="json_schema: keyword 'maximum' is not supported"):
        grammar.tool_call_grammar(frame, json.dumps({"type": "integer", "maximum": 3}))


async def test_generation_with_a_frame_and_an_answer_ends_in_either(load: Loader, tmp_path: Path) -> None:
    """The backend's params -> grammar: a frame and json_schema generate, steered either way,
    a complete call or a complete answer, and end there (a token the grammar rejects would
    abort llama.cpp)."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", n_ctx=1024))
    frame, _ = ANSWERED_FRAMES["json"]
    for start, want in (("<", "<tool_call>\n"), ("{", '{"v"')):
        bias = {259 + ord(start) - 0x20: 30.0}
        params = GenerateParams(temperature=1.0, seed=1, max_tokens=300, tool_calls=frame,
                                json_schema=json.dumps(ANSWER_X), logit_bias=bias)
        text, finish = await text_of(backend, PROMPT, params)
        assert finish == "stop" and text.startswith(want), text
        if start == "{":
            assert isinstance(json.loads(text)["v"], int)
        else:
            assert json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))["arguments"] == {"v": "s"}


# --------------------------------------------------------------------------- a tool's own $defs

# Pydantic's shape: a nested model in the parameters' own `$defs`. Two tools define `Point`
# differently; each call's schema must hold to its own.
POINT_TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
        "additionalProperties": False,
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": kind}}, "required": ["x"],
                            "additionalProperties": False}},
    }}}
    for name, kind in (("ints", "integer"), ("texts", "string"))
]


@pytest.mark.parametrize("syntax", ["hermes", "mistral", "apertus", ""])
async def test_tool_parameters_keep_their_own_defs(load: Loader, tmp_path: Path, syntax: str) -> None:
    """A tool's parameters are a schema document of their own: inside the call's schema (a JSON
    object frame, the generic reply), their `#/$defs/Point` is still theirs. It was a 400 ("$defs
    not in ...": the reference was looked up from the call schema's root) for every client whose
    tools come from Pydantic models with a nested one."""
    from daemon.api import openai_tools

    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    tools = msgspec.convert(POINT_TOOLS, list[openai_tools.Tool])
    use = openai_tools.ToolUse(syntax, tools, "required", parallel=False)
    params = GenerateParams()
    use.constrain(params)
    if params.tool_calls is not None:
        text = grammar.tool_call_grammar(params.tool_calls)
    else:
        text = grammar.schema_to_grammar(params.json_schema, "json_schema")
    calls = {
        "hermes": '<tool_call>\n{"name": "NAME", "arguments": {"p": {"x": X}}}\n</tool_call>',
        "mistral": '[TOOL_CALLS][{"name": "NAME", "arguments": {"p": {"x": X}}, "id": "abcdefghi"}]',
        "apertus": '<|tools_prefix|>[{"NAME": {"p": {"x": X}}}]<|tools_suffix|>',
        "": '{"tool_calls": [{"name": "NAME", "arguments": {"p": {"x": X}}}]}',
    }[syntax]
    for name, value, accepted in [("ints", "3", True), ("texts", '"a"', True), ("ints", '"a"', False),
                                  ("texts", "3", False)]:
        whole = calls.replace("NAME", name).replace("X", value)
        count = backend._engine._grammar_accepts(text, whole)
        assert (count == len(whole.encode())) is accepted, (whole, count)


# A property whose name is a keyword that holds values elsewhere (`default`), referring to a
# definition: its schema is walked like any other property's.
DEFAULT_TOOL = [{"type": "function", "function": {"name": "paint", "parameters": {
    "type": "object", "properties": {"default": {"$ref": "#/$defs/Color"}}, "required": ["default"],
    "additionalProperties": False, "$defs": {"Color": {"enum": ["red", "blue"]}},
}}}]


@pytest.mark.parametrize("syntax", ["hermes", ""])
async def test_a_property_named_like_a_value_keyword_keeps_its_ref(load: Loader, tmp_path: Path, syntax: str) -> None:
    from daemon.api import openai_tools

    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    tools = msgspec.convert(DEFAULT_TOOL, list[openai_tools.Tool])
    params = GenerateParams()
    openai_tools.ToolUse(syntax, tools, "required", parallel=False).constrain(params)
    if params.tool_calls is not None:
        text = grammar.tool_call_grammar(params.tool_calls)
        call = '<tool_call>\n{"name": "paint", "arguments": {"default": V}}\n</tool_call>'
    else:
        text = grammar.schema_to_grammar(params.json_schema, "json_schema")
        call = '{"tool_calls": [{"name": "paint", "arguments": {"default": V}}]}'
    for value, accepted in (('"red"', True), ('"green"', False)):
        whole = call.replace("V", value)
        assert (backend._engine._grammar_accepts(text, whole) == len(whole.encode())) is accepted, whole


async def test_refs_of_a_response_format_resolve_from_its_root(load: Loader, tmp_path: Path) -> None:
    """`#/properties/name` means the root's `name` (a string), not the nearer `child`'s (an
    integer); a definition named `default` among `$defs` is one like any other."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    schema = {
        "type": "object", "additionalProperties": False, "required": ["name", "child"],
        "properties": {
            "name": {"type": "string"},
            "child": {"type": "object", "additionalProperties": False, "required": ["name", "alias", "d"],
                      "properties": {"name": {"type": "integer"}, "alias": {"$ref": "#/properties/name"},
                                     "d": {"$ref": "#/$defs/default"}}},
        },
        "$defs": {"default": {"const": 7}},
    }
    text = grammar.schema_to_grammar(json.dumps(schema), "json_schema")
    for alias, d, accepted in (('"s"', "7", True), ("3", "7", False), ('"s"', "8", False)):
        whole = f'{{"name": "n", "child": {{"name": 1, "alias": {alias}, "d": {d}}}}}'
        assert (backend._engine._grammar_accepts(text, whole) == len(whole.encode())) is accepted, whole


async def test_keywords_of_the_wrong_json_type_are_refused_by_name(load: Loader, tmp_path: Path) -> None:
    """A `type` or `format` that is an array or object, or `anyOf` that is not an array: a 400
    naming the keyword (they were looked up in a set, or iterated: a TypeError, a 500)."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    refused = [
        ({"type": {}}, r"^json_schema\.type: unknown type \{\}$"),
        ({"type": ["string", ["null"]]}, r"^json_schema\.type: unknown type \['null'\]$"),
        ({"properties": {"a": {"type": "string", "format": ["date"]}}}, r"^json_schema\.properties\.a\.format: "),
        ({"anyOf": 1}, r"^json_schema\.anyOf: must be an array$"),
        ({"prefixItems": None}, r"^json_schema\.prefixItems: must be an array$"),
        ({"properties": {"b": {"oneOf": {"type": "string"}}}}, r"^json_schema\.properties\.b\.oneOf: must be an array$"),
    ]
    for schema, pattern in refused:
        with pytest.raises(InvalidArgument, match=pattern):
            grammar.schema_to_grammar(json.dumps(schema), "json_schema")


async def test_bounds_that_keep_llama_cpps_grammar_parser_on_its_stack(load: Loader, tmp_path: Path) -> None:
    """Repetition counts, schema depth, grammar size and nesting are bounded before anything is
    written out or parsed; parentheses inside literals, classes and comments are not groups."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(65):
        deep = {"type": "array", "items": deep}
    refused = [
        ({"type": "string", "maxLength": 1001}, r"^json_schema\.maxLength: must be an integer from 0 to 1000, got 1001$"),
        ({"type": "array", "minItems": 10**7}, r"^json_schema\.minItems: must be an integer from 0 to 1000, got 10000000$"),
        ({"type": "string", "minLength": 2.0}, r"^json_schema\.minLength: must be an integer from 0 to 1000, got 2\.0$"),
        ({"type": "string", "minLength": True}, r"^json_schema\.minLength: .* got True$"),
        ({"type": "array", "minItems": -1}, r"^json_schema\.minItems: .* got -1$"),
        ({"type": "array", "maxItems": None}, r"^json_schema\.maxItems: .* got None$"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, r"^json_schema\.minItems: more than maxItems$"),
        (deep, r"^json_schema(\.items){65}: nested more than 64 levels deep$"),
    ]
    for schema, pattern in refused:
        with pytest.raises(InvalidArgument, match=pattern):
            grammar.schema_to_grammar(json.dumps(schema), "json_schema")
    with pytest.raises(InvalidArgument, match=r"^json_schema: not valid JSON: maximum recursion depth"):
        grammar.schema_to_grammar("[" * 100_000 + "]" * 100_000, "json_schema")
    text = grammar.schema_to_grammar(json.dumps({"type": "string", "minLength": 1000, "maxLength": 1000}), "j")
    assert backend._engine._grammar_accepts(text, '"' + "x" * 1000 + '"') == 1002
    grammar.check_grammar("root ::= " + "(" * 2048 + '"a"' + ")" * 2048, "grammar")
    with pytest.raises(InvalidArgument, match=r"^grammar: groups nested 2049 deep, more than the 2048 allowed$"):
        grammar.check_grammar("root ::= " + "(" * 2049 + '"a"' + ")" * 2049, "grammar")
    # Not groups: in a literal (with an escaped quote), a class (with an escaped bracket), a comment.
    grammar.check_grammar('root ::= "\\"' + "(" * 3000 + '" [\\]' + "(" * 3000 + "] # " + "(" * 3000 + "\n", "grammar")
    # A repetition's minimum above its maximum: llama.cpp allocated until memory ran out.
    grammar.check_grammar('root ::= "x"{5,5} "y"{3,} "z"{,2} "{9,1}"', "grammar")
    with pytest.raises(InvalidArgument, match=r"^grammar: repetition \{6,4\} has its minimum above its maximum$"):
        grammar.check_grammar('root ::= "x"{6,4}', "grammar")
    with pytest.raises(InvalidArgument, match=r"^tools: 8388609 bytes, more than the 8388608 a grammar may have$"):
        grammar.check_grammar("x" * (8 * 1024 * 1024 + 1), "tools")
    chain = "".join(f"r{i} ::= r{i + 1}\n" for i in range(19_999)) + 'r19999 ::= "b"\n'
    grammar.check_grammar(chain, "grammar")  # 20 000 rules
    assert backend._engine._grammar_accepts(chain.replace("r0 ::=", "root ::=", 1), "b") == 1
    with pytest.raises(InvalidArgument, match=r"^grammar: 20001 rules, more than the 20000 a grammar may have$"):
        grammar.check_grammar(chain + 'r20000 ::= "c"\n', "grammar")
    # 500 strings of maxLength 1 000: 4 MB of grammar, taken.
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 1000} for i in range(500)}}
    assert len(grammar.schema_to_grammar(json.dumps(wide), "json_schema")) > 4_000_000


# --------------------------------------------------------------------------- schemas the converter misread


def _accepts(backend: Any, grammar_text: str, cases: list[tuple[str, bool]]) -> None:
    for whole, accepted in cases:
        count = backend._engine._grammar_accepts(grammar_text, whole)
        assert (count == len(whole.encode())) is accepted, (whole, count)


@pytest.mark.parametrize("syntax", ["hermes", ""])
async def test_schemas_that_hold_to_nothing(load: Loader, tmp_path: Path, syntax: str) -> None:
    """`"parameters": {}` (or a title alone) is a tool whose arguments are any object: it was a
    400 ("Unrecognized schema": the parameters' `$id` left the converter nothing it knew). A
    property whose schema is `true`, {} or a title alone (Pydantic's `Any`) takes any JSON
    value: `true` was a 500 (the converter calls .get on it), {} held it to an object and a
    title alone was a 400."""
    from daemon.api import openai_tools

    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    call = {"hermes": '<tool_call>\n{"name": "f", "arguments": ARGS}\n</tool_call>',
            "": '{"tool_calls": [{"name": "f", "arguments": ARGS}]}'}[syntax]

    def grammar_of(parameters: dict[str, Any]) -> str:
        tools = msgspec.convert([{"type": "function", "function": {"name": "f", "parameters": parameters}}],
                                list[openai_tools.Tool])
        params = GenerateParams()
        openai_tools.ToolUse(syntax, tools, "required", parallel=False).constrain(params)
        if params.tool_calls is not None:
            return str(grammar.tool_call_grammar(params.tool_calls))
        return str(grammar.schema_to_grammar(params.json_schema, "json_schema"))

    for parameters in ({}, {"title": "Args"}):
        _accepts(backend, grammar_of(parameters), [
            (call.replace("ARGS", "{}"), True), (call.replace("ARGS", '{"x": [1]}'), True),
            (call.replace("ARGS", "3"), False),
        ])
    for anything in (True, {}, {"title": "Data"}):
        text = grammar_of({"type": "object", "properties": {"p": anything, "q": {"type": "array", "items": anything}},
                           "required": ["p"], "additionalProperties": False})
        _accepts(backend, text, [
            (call.replace("ARGS", '{"p": 3}'), True), (call.replace("ARGS", '{"p": "s", "q": [null, {"a": 1}]}'), True),
            (call.replace("ARGS", '{"p": {"k": [true]}}'), True), (call.replace("ARGS", '{"q": []}'), False),
        ])


async def test_a_root_reference_resolves_the_references_of_its_target(load: Loader, tmp_path: Path) -> None:
    """zod-to-json-schema's shape ({"$ref": "#/definitions/X", "definitions": {...}}) with a
    reference inside X: the converter skips the keys beside a `$ref`, so the root's definitions
    went unresolved and a valid format was a 400 ("'#/$defs/edged-ref-0-0'")."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    schema = {"$ref": "#/definitions/Node", "definitions": {"Node": {
        "type": "object", "properties": {"v": {"$ref": "#/definitions/Value"}, "next": {"$ref": "#/definitions/Node"}},
        "required": ["v"], "additionalProperties": False}, "Value": {"type": "integer"}}}
    _accepts(backend, grammar.schema_to_grammar(json.dumps(schema), "json_schema"), [
        ('{"v": 1}', True), ('{"v": 1, "next": {"v": 2}}', True), ('{"v": "a"}', False), ('{"v": 1, "next": {}}', False),
    ])


async def test_a_property_named_ref_is_a_property(load: Loader, tmp_path: Path) -> None:
    """A property may be named "$ref" (JSON Schema reads `properties` as names, not keywords).
    The converter's own resolver read it as a reference and failed on its schema: a 400 for a
    valid format."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    schema = {"type": "object", "additionalProperties": False, "required": ["$ref"],
              "properties": {"$ref": {"type": "string"}, "n": {"$ref": "#/$defs/N"}}, "$defs": {"N": {"type": "integer"}}}
    _accepts(backend, grammar.schema_to_grammar(json.dumps(schema), "json_schema"), [
        ('{"$ref": "a"}', True), ('{"$ref": "a", "n": 2}', True), ('{"n": 2}', False),
        ('{"$ref": 1}', False), ('{"$ref": "a", "n": "2"}', False),
    ])


CYCLES = [
    {"$ref": "#"},
    {"anyOf": [{"type": "integer"}, {"$ref": "#"}]},
    {"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}}},
]


@pytest.mark.parametrize("schema", CYCLES)
async def test_a_reference_cycle_before_any_value_is_refused(load: Loader, tmp_path: Path, schema: dict[str, Any]) -> None:
    """A schema that refers back to itself before any value ({"$ref": "#"}) holds no JSON
    text; its grammar is left-recursive, which llama.cpp refuses as "grammar: could not parse"
    for a request that sent no grammar. A 400 naming the field instead, in both syntaxes; a
    cycle through a value (a list of itself) stays a grammar."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    with pytest.raises(InvalidArgument, match=r"^json_schema: cannot be turned into a grammar: a \$ref leads back to itself"):
        grammar.schema_to_grammar(json.dumps(schema), "json_schema")
    gemma = ToolCallFrame(named_calls={"f": json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}},
                                                         "$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}]}}})}, **GEMMA)
    with pytest.raises(InvalidArgument, match=r"^tools\[f\]\.parameters: a \$ref leads back to itself"):
        grammar.tool_call_grammar(gemma)
    fine = {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#"}}]}
    _accepts(backend, grammar.schema_to_grammar(json.dumps(fine), "json_schema"), [
        ("[1, [2, []]]", True), ("3", True), ('["a"]', False)])


async def test_references_are_uri_fragments(load: Loader, tmp_path: Path) -> None:
    """A reference is a URI fragment holding a JSON pointer: percent-decoded first (a
    definition named "My Point" is `#/$defs/My%20Point`), then ~1 and ~0. The percent-encoded
    one was a 400 for a valid schema."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b", "c"],
              "properties": {"a": {"$ref": "#/$defs/My%20Point"}, "b": {"$ref": "#/$defs/x~1y"},
                             "c": {"$ref": "#/$defs/t~0x"}},
              "$defs": {"My Point": {"type": "integer"}, "x/y": {"const": "s"}, "t~x": {"type": "boolean"}}}
    _accepts(backend, grammar.schema_to_grammar(json.dumps(schema), "json_schema"), [
        ('{"a": 1, "b": "s", "c": true}', True), ('{"a": "1", "b": "s", "c": true}', False),
        ('{"a": 1, "b": "t", "c": true}', False), ('{"a": 1, "b": "s", "c": 1}', False),
    ])


async def test_an_all_of_of_one_schema_is_that_schema(load: Loader, tmp_path: Path) -> None:
    """Pydantic v1 writes a described field as {"description": ..., "allOf": [{"$ref": ...}]}.
    The converter read allOf as a merge of objects' properties, all required: an enum's value
    was held to `{}` (which the schema forbids; its values could not be written) and a model's
    optional fields were required."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    schema = {"type": "object", "required": ["color", "size"], "additionalProperties": False, "properties": {
        "color": {"description": "Its color", "allOf": [{"$ref": "#/definitions/Color"}]},
        "size": {"title": "Size", "allOf": [{"$ref": "#/definitions/Size"}]}},
        "definitions": {"Color": {"title": "Color", "enum": ["red", "blue"], "type": "string"},
                        "Size": {"type": "object", "properties": {"w": {"type": "integer"}, "h": {"type": "integer"}},
                                 "required": ["w"], "additionalProperties": False}}}
    _accepts(backend, grammar.schema_to_grammar(json.dumps(schema), "json_schema"), [
        ('{"color": "red", "size": {"w": 1}}', True), ('{"color": "blue", "size": {"w": 1, "h": 2}}', True),
        ('{"color": {}, "size": {"w": 1}}', False), ('{"color": "green", "size": {"w": 1}}', False),
    ])


async def test_keywords_beside_a_ref_are_refused(load: Loader, tmp_path: Path) -> None:
    """The converter writes a `$ref`'s target alone: an enum (or any other keyword it holds)
    beside it was dropped without a word, and any string passed. A 400 naming it instead."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/S", "enum": ["x"]}}, "$defs": {"S": {"type": "string"}}}
    with pytest.raises(InvalidArgument, match=r"json_schema\.properties\.a: keyword 'enum' beside '\$ref' is not supported"):
        grammar.schema_to_grammar(json.dumps(schema), "json_schema")
    # Annotations beside it (Pydantic's description and default) are taken.
    schema["properties"]["a"] = {"$ref": "#/$defs/S", "description": "A", "default": "x"}
    _accepts(backend, grammar.schema_to_grammar(json.dumps(schema), "json_schema"), [('{"a": "y"}', True), ('{"a": 1}', False)])
    # The target's own type beside it (as OpenAPI generators write) is taken; another is a 400.
    schema["properties"]["a"] = {"$ref": "#/$defs/S", "type": "string"}
    _accepts(backend, grammar.schema_to_grammar(json.dumps(schema), "json_schema"), [('{"a": "y"}', True), ('{"a": 1}', False)])
    schema["properties"]["a"] = {"$ref": "#/$defs/S", "type": "integer"}
    with pytest.raises(InvalidArgument, match=r"keyword 'type' beside '\$ref' '#/\$defs/S' is not supported unless"):
        grammar.schema_to_grammar(json.dumps(schema), "json_schema")


async def test_an_all_of_of_several_schemas_holds_what_its_merge_keeps(load: Loader, tmp_path: Path) -> None:
    """The converter reads an allOf of several schemas as their objects' properties merged, all
    required, no others. OpenAPI's inheritance (a base by $ref, then more properties) means
    that and is taken; what the merge would drop is a 400: a part's additionalProperties false
    (the other parts' properties then break it), a part's enum, keywords beside the allOf, a
    part requiring a property it does not list. Before, each was accepted and output the
    schema forbids (or lacking what it requires) got through."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    base = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    schema = {"$defs": {"Base": base}, "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"name": {"type": "string"}}}]}
    _accepts(backend, grammar.schema_to_grammar(json.dumps(schema), "json_schema"), [
        ('{"id": 1, "name": "a"}', True), ('{"id": "1", "name": "a"}', False), ('{"id": 1, "x": 2}', False),
    ])
    refused = [
        ({**base, "additionalProperties": False}, r"allOf\[0\]: keyword 'additionalProperties' is not supported"),
        ({"enum": [{"id": 1}]}, r"allOf\[0\]: keyword 'enum' is not supported"),
        ({"type": "object", "properties": {}, "required": ["id"]}, r"\$defs\.Base\.required: 'id' has no schema in 'properties'"),
        ({"type": "string"}, r"allOf\[0\]: only object schemas"),
    ]
    for first, pattern in refused:
        bad = {"$defs": {"Base": first}, "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"name": {"type": "string"}}}]}
        with pytest.raises(InvalidArgument, match=pattern):
            grammar.schema_to_grammar(json.dumps(bad), "json_schema")
    beside = {**schema, "required": ["extra"]}
    with pytest.raises(InvalidArgument, match=r"allOf of several schemas beside 'required'"):
        grammar.schema_to_grammar(json.dumps(beside), "json_schema")


REFUSED_SCHEMAS = [
    # The converter wrote an empty rule, which llama.cpp refused naming no field.
    ({"type": []}, r"\.a\.type: an empty array matches nothing"),
    ({"enum": []}, r"\.a\.enum: an empty array matches nothing"),
    ({"anyOf": []}, r"\.a\.anyOf: an empty array matches nothing"),
    ({"type": "string", "enum": []}, r"\.a\.enum: an empty array matches nothing"),
    # Its own errors (a KeyError, a TypeError) were the only words.
    ({"oneOf": []}, r"\.a\.oneOf: an empty array matches nothing"),
    ({"type": "array", "items": []}, r"\.a\.items: an empty array is not a schema here"),
    ({"enum": 5}, r"\.a\.enum: must be an array"),
    ({"$ref": "#/$defs/nope"}, r": cannot be turned into a grammar: \$ref '#/\$defs/nope' points at nothing in the schema"),
    # Taken, and not held to: "x" required "x" (a text is a sequence), a required property
    # without a schema was left out, 5 was read as false, and an enum's value of another type
    # than the schema's was generated.
    ({"type": "object", "properties": {"x": {}}, "required": "x"}, r"\.a\.required: must be an array of property names"),
    ({"type": "object", "properties": {"x": {}}, "required": ["y"]}, r"\.a\.required: 'y' has no schema in 'properties'"),
    ({"type": "object", "additionalProperties": 5}, r"\.a\.additionalProperties: must be a boolean or a schema"),
    ({"type": "integer", "enum": ["x", 1]}, r"\.a: the value \"x\" in enum/const is not of its type \"integer\""),
    ({"type": "boolean", "const": 1}, r"\.a: the value 1 in enum/const is not of its type \"boolean\""),
    ({"type": ["string", "null"], "enum": ["s", 2]}, r"\.a: the value 2 in enum/const is not of its type \[\"string\", \"null\"\]"),
    # The converter wrote the enum, the const or the branches alone, the rest dropped.
    ({"type": "string", "enum": ["abc"], "maxLength": 2}, r"\.a: keyword 'maxLength' beside 'enum' is not supported"),
    ({"const": "x", "pattern": "^y$"}, r"\.a: keyword 'pattern' beside 'const' is not supported"),
    ({"enum": ["a"], "anyOf": [{"type": "string"}]}, r"\.a: keyword 'anyOf' beside 'enum' is not supported"),
    ({"type": "object", "properties": {"p": {"type": "integer"}}, "oneOf": [{"type": "object"}]},
     r"\.a: keyword 'properties' beside 'oneOf' is not supported"),
    ({"type": "object", "oneOf": [{"type": "string"}]}, r"\.a\.oneOf\[0\]: type 'string' is not among the types beside it"),
    # ... and read `items`, dropping `prefixItems`.
    ({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}},
     r"\.a: keyword 'items' beside 'prefixItems' is not supported"),
    # The converter writes a counted character out before the grammar's size is known:
    # a{2147483647} took 6 GB and 25 s (on the event loop), a{10**20} was a 500, and nested
    # counts kept it busy for minutes. An escaped backslash's count is a count; an escaped
    # brace is a character.
    ({"type": "string", "pattern": "^a{2147483647}$"}, r"\.a\.pattern: repetition \{2147483647\} counts past 1000"),
    ({"type": "string", "pattern": "^a{1,100000000000000000000}$"},
     r"\.a\.pattern: repetition \{1,100000000000000000000\} counts past 1000"),
    ({"type": "string", "pattern": "^\\\\{2000}$"}, r"\.a\.pattern: repetition \{2000\} counts past 1000"),
    ({"type": "string", "pattern": "^((a{1000}){1000}){1000}$"},
     r"\.a\.pattern: its counted repetitions write out 1000000000 characters and classes, more than the 100000"),
    ({"type": "string", "pattern": "^(ab|[a-z]{400}){300}$"},
     r"\.a\.pattern: its counted repetitions write out 120600 characters"),
    # The converter never returned (a lone "}", an empty class), raised an IndexError (a 500),
    # or wrote a grammar of another language ({2,1} as two, (a|b){2}? as one or two).
    ({"type": "string", "pattern": "^a{1,2}}$"}, r"\.a\.pattern: '}' at 7 closes no '\{' \(a literal one is written"),
    ({"type": "string", "pattern": "^\\{3}$"}, r"\.a\.pattern: '}' at 4 closes no '\{'"),
    ({"type": "string", "pattern": "^[]a]$"}, r"\.a\.pattern: the empty character class at 1 \('\[\]' or '\[\^\]'\)"),
    ({"type": "string", "pattern": "^*$"}, r"\.a\.pattern: '\*' at 1 has nothing to repeat"),
    ({"type": "string", "pattern": "^(a|?)$"}, r"\.a\.pattern: '\?' at 4 has nothing to repeat"),
    ({"type": "string", "pattern": "^a{2,1}$"}, r"\.a\.pattern: repetition \{2,1\} has its minimum above its maximum"),
    ({"type": "string", "pattern": "^(a|b){2}?$"}, r"\.a\.pattern: the lazy quantifier at 9 is not supported"),
    ({"type": "string", "pattern": "^a+?$"}, r"\.a\.pattern: the lazy quantifier at 3 is not supported"),
]


async def test_schemas_the_grammar_could_not_hold_to_are_refused_naming_the_keyword(load: Loader, tmp_path: Path) -> None:
    """Found by sending mutated requests: each of these was a grammar llama.cpp refused ("could
    not parse it", no field named), a converter error's bare words, or a grammar that let
    through output the schema forbids. Each is a 400 naming where it is now; the valid
    neighbours are taken and held to."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")

    def schema(inner: Any) -> str:
        return json.dumps({"type": "object", "properties": {"a": inner}, "required": ["a"], "additionalProperties": False})

    for inner, pattern in REFUSED_SCHEMAS:
        with pytest.raises(InvalidArgument, match=r"^json_schema\S*" + pattern):
            grammar.schema_to_grammar(schema(inner), "json_schema")
    _accepts(backend, grammar.schema_to_grammar(schema({"type": "string", "pattern": "^\\{3\\}x{2}(ab)*$"}), "json_schema"), [
        ('{"a": "{3}xx"}', True), ('{"a": "{3}xxabab"}', True), ('{"a": "{{{xx"}', False), ('{"a": "{3}xxa"}', False)])
    _accepts(backend, grammar.schema_to_grammar(schema({"type": "integer", "enum": [1, 2.0]}), "json_schema"), [
        ('{"a": 1}', True), ('{"a": 2.0}', True), ('{"a": 3}', False)])
    _accepts(backend, grammar.schema_to_grammar(schema({"type": ["string", "null"], "enum": ["s", None]}), "json_schema"), [
        ('{"a": "s"}', True), ('{"a": null}', True), ('{"a": "t"}', False)])
    pydantic_optional = {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "A"}
    _accepts(backend, grammar.schema_to_grammar(schema(pydantic_optional), "json_schema"), [
        ('{"a": "s"}', True), ('{"a": null}', True), ('{"a": 1}', False)])
    nested = {"type": "object", "properties": {"p": {"type": "string"}}, "required": ["p"], "additionalProperties": False}
    _accepts(backend, grammar.schema_to_grammar(schema(nested), "json_schema"), [
        ('{"a": {"p": "v"}}', True), ('{"a": {}}', False)])


async def test_a_list_of_types_holds_to_the_schemas_other_keywords(load: Loader, tmp_path: Path) -> None:
    """OpenAI's strict mode writes an optional field as {"type": [..., "null"], ...}. The
    converter read such a list as its types alone: the object's properties, an enum, a
    maxLength beside it held to nothing (any object, any text went through). Also here: an
    object's declared properties beside additionalProperties."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    optional = {"type": ["object", "null"], "properties": {"p": {"type": "integer"}}, "required": ["p"],
                "additionalProperties": False}
    cases: list[tuple[dict[str, Any], list[tuple[str, bool]]]] = [
        (optional, [('{"p": 1}', True), ("null", True), ("{}", False), ('{"p": "1"}', False), ('{"p": 1, "q": 2}', False)]),
        ({"type": ["string", "null"], "maxLength": 2}, [('"ab"', True), ("null", True), ('"abc"', False)]),
        ({"type": ["string", "null"], "enum": ["s", None]}, [('"s"', True), ("null", True), ('"t"', False)]),
        ({"type": ["integer"], "enum": [3]}, [("3", True), ("4", False)]),
    ]
    for inner, texts in cases:
        _accepts(backend, grammar.schema_to_grammar(json.dumps(inner), "json_schema"), texts)
    # Declared properties beside others allowed: the declared ones alone (any key was let
    # through with the others' schema, a declared one too, and a declared one before others
    # could not be written at all).
    for extra in (True, {"type": "integer"}):
        mixed = {"type": "object", "properties": {"p": {"type": "string"}}, "additionalProperties": extra}
        _accepts(backend, grammar.schema_to_grammar(json.dumps(mixed), "json_schema"), [
            ('{"p": "x"}', True), ("{}", True), ('{"p": 5}', False), ('{"p": "x", "k": 1}', False), ('{"k": 1}', False)])
    only_extra = {"type": "object", "additionalProperties": {"type": "integer"}}
    _accepts(backend, grammar.schema_to_grammar(json.dumps(only_extra), "json_schema"), [
        ('{"k": 1, "j": 2}', True), ('{"k": "x"}', False)])
    with pytest.raises(InvalidArgument, match=r"^json_schema: cannot be turned into a grammar: a list of types beside anyOf"):
        grammar.schema_to_grammar(json.dumps({"type": ["string", "null"], "anyOf": [{"maxLength": 1}]}), "json_schema")


async def test_gemma_arguments_may_refer_to_themselves(load: Loader, tmp_path: Path) -> None:
    """A recursive schema (a tree of nodes, each with a list of nodes; the root by `#`) in
    Gemma 4's syntax: each reference's target is one rule that refers to itself. The target was
    written out again at each reference, so such a tool was a 400 ("nested too deeply")."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", user_tokens=GEMMA_TOKENS))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")
    tree = {"type": "object", "required": ["node"], "additionalProperties": False,
            "properties": {"node": {"$ref": "#/$defs/Node"}, "more": {"$ref": "#"}},
            "$defs": {"Node": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}}}
    text = grammar.tool_call_grammar(ToolCallFrame(named_calls={"f": json.dumps(tree)}, **GEMMA))

    def call(arguments: str) -> str:
        return f"<|tool_call>call:f{arguments.replace(chr(34), grammar.GEMMA_QUOTE)}<tool_call|>"

    deep = "".join('{name:"n",children:[' for _ in range(40)) + '{name:"leaf"}' + "]}" * 40
    _accepts(backend, text, [
        (call('{node:{name:"a"}}'), True),
        (call('{node:{name:"a",children:[{name:"b"},{name:"c",children:[]}]}}'), True),
        (call('{node:{name:"a"},more:{node:{name:"b",children:[{name:"c"}]}}}'), True),
        (call("{node:" + deep + "}"), True),
        (call('{node:{name:"a",children:[{children:[]}]}}'), False),
        (call('{node:{name:"a",children:[{name:1}]}}'), False),
        (call('{more:{node:{name:"b"}}}'), False),
    ])


async def test_gemma_declared_properties_beside_others_hold_to_their_schemas(load: Loader, tmp_path: Path) -> None:
    """In Gemma 4's syntax an object allowing other properties was any object, its declared
    properties holding anything; now the declared ones alone, as in JSON. A schema for the
    others without declared ones is a 400 (any key and value would not hold to it)."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", user_tokens=GEMMA_TOKENS))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")

    def call(arguments: str) -> str:
        return f"<|tool_call>call:f{arguments.replace(chr(34), grammar.GEMMA_QUOTE)}<tool_call|>"

    mixed = {"type": "object", "properties": {"p": {"type": "string"}}, "additionalProperties": True}
    text = grammar.tool_call_grammar(ToolCallFrame(named_calls={"f": json.dumps(mixed)}, **GEMMA))
    _accepts(backend, text, [(call('{p:"x"}'), True), (call("{p:5}"), False), (call('{p:"x",k:1}'), False)])
    values = {"type": "object", "additionalProperties": {"type": "integer"}}
    with pytest.raises(InvalidArgument, match=r"additionalProperties: a schema here is not supported in Gemma 4's syntax"):
        grammar.tool_call_grammar(ToolCallFrame(named_calls={"f": json.dumps(values)}, **GEMMA))
    # A list of item schemas (draft 7's tuples) was any item; a 400 now.
    tuple_form = {"type": "object", "properties": {"xs": {"type": "array", "items": [{"type": "integer"}]}}}
    with pytest.raises(InvalidArgument, match=r"\.xs\.items: a list of item schemas cannot be enforced in Gemma 4's"):
        grammar.tool_call_grammar(ToolCallFrame(named_calls={"f": json.dumps(tuple_form)}, **GEMMA))


async def test_gemma_holds_a_type_beside_a_ref_to_the_targets(load: Loader, tmp_path: Path) -> None:
    """Gemma 4's argument syntax writes a `$ref`'s target alone, as the JSON converter does: a
    `type` beside it is taken where it is the target's own, else a 400 naming it."""
    backend = await load(write_tiny_llama(tmp_path / "model.gguf"))
    grammar = importlib.import_module(type(backend).__module__.rsplit(".", 1)[0] + ".grammar")

    def frame(kind: str) -> ToolCallFrame:
        schema = {"type": "object", "properties": {"c": {"$ref": "#/$defs/C", "type": kind}},
                  "$defs": {"C": {"type": "object", "properties": {"r": {"type": "integer"}}}}}
        return ToolCallFrame(named_calls={"f": json.dumps(schema)}, **GEMMA)

    assert "root" in grammar.tool_call_grammar(frame("object"))
    with pytest.raises(InvalidArgument, match=r"keyword 'type' beside '\$ref' is not supported unless"):
        grammar.tool_call_grammar(frame("string"))
