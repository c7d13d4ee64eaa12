"""Tool calls in the model's own syntax, end to end: the `openai` client and Ollama's API
against tiny GGUF models carrying real Qwen 2.5, Mistral Nemo and Llama 3.1 chat templates."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from gguf_builder import _vocab, write_tiny_llama  # noqa: E402

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
MODELS = {
    "qwen": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "mistral": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "llama31": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    # Newer Mistral templates: `[TOOL_CALLS]name[ARGS]{...}`, Mistral Small 3.2 with [CALL_ID].
    "ministral": "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
    "mistral32": "Mistral-Small-3.2-24B-Instruct-2506.jinja",
}
# The markers that are control tokens in the real vocabularies of the newer Mistral models.
CONTROL_TOKENS = {"ministral": ("[TOOL_CALLS]", "[ARGS]"), "mistral32": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")}
# How each syntax's reply begins (what a reply cut after a few tokens shows as content).
OPENS = {"qwen": "<tool_call>\n{", "mistral": "[TOOL_CALLS][{", "llama31": "{", "ministral": "[TOOL_CALLS]",
         "mistral32": "[TOOL_CALLS]"}
# Mistral's templates take back only call ids of 9 letters and digits.
NINE_CHARACTER_IDS = {"mistral", "ministral", "mistral32"}
# Ministral 3 may reason ([THINK] ... [/THINK]) before a required call, which the tiny model
# would do forever: kept from it (the tag's first character, as a piece or a byte; the call's
# markers are tokens of their own).
NO_REASONING = {"ministral": {"logit_bias": {
    str(i): -100 for i, t in enumerate(_vocab()[0]) if t.lstrip("\u2581").startswith("[") or t == "<0x5B>"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False},
}}
LIGHTS = {"type": "function", "function": {"name": "lights_off", "description": "Lights off"}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    from support import start_daemon_process

    repo = tmp_path_factory.mktemp("tool-templates")
    for name, template in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        write_tiny_llama(repo / name / "1" / "model.gguf", seed=3, n_ctx=4096,
                         chat_template=(TEMPLATES / template).read_text(), control_tokens=CONTROL_TOKENS.get(name, ()))
        (repo / name / "config.pbtxt").write_text('backend: "llamacpp"\n')
    # Mistral's real vocabulary has [TOOL_CALLS] as a control token (which detokenizes to nothing).
    (repo / "mistral_ctrl" / "1").mkdir(parents=True)
    write_tiny_llama(repo / "mistral_ctrl" / "1" / "model.gguf", seed=3, n_ctx=4096,
                     chat_template=(TEMPLATES / MODELS["mistral"]).read_text(), control_tokens=("[TOOL_CALLS]",))
    (repo / "mistral_ctrl" / "config.pbtxt").write_text('backend: "llamacpp"\n')
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield process
    process.stop()


QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("model", list(MODELS))
def test_the_reply_is_written_in_the_models_syntax(client: openai.OpenAI, model: str) -> None:
    # Cut before the call's name is complete, the reply is its raw text: the model's own
    # syntax (the generic reply would begin '{"tool_calls"').
    cut = client.chat.completions.create(
        model=model, messages=QUESTION, tools=[WEATHER, LIGHTS], tool_choice="required", temperature=0,
        # A few tokens past the opening (one token where it is a control token).
        max_tokens=3 if model in CONTROL_TOKENS else len(OPENS[model]) + 2, **NO_REASONING.get(model, {}),
    ).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls is None
    assert (cut.message.content or "").startswith(OPENS[model]), cut.message.content


@pytest.mark.parametrize("model", list(MODELS))
def test_required_and_named_calls_parse_and_stream_alike(client: openai.OpenAI, model: str) -> None:
    for seed in (1, 2, 3):
        kwargs = {"model": model, "messages": QUESTION, "tools": [WEATHER, LIGHTS], "tool_choice": "required",
                  "parallel_tool_calls": False, "seed": seed, "temperature": 1.0, "max_tokens": 300,
                  **NO_REASONING.get(model, {})}
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].function.name in ("get_weather", "lights_off")
        arguments = json.loads(calls[0].function.arguments)
        assert arguments in ({"city": "Paris"}, {"city": "Oslo"}, {})
        # Mistral's template takes back only ids of 9 letters and digits.
        assert re.fullmatch(r"[A-Za-z0-9]{9}" if model in NINE_CHARACTER_IDS else r"call_[0-9a-f]{24}", calls[0].id)
        names, streamed, finish = [], "", None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for delta in chunk.choices:
                assert not delta.delta.content
                for call in delta.delta.tool_calls or []:
                    names += [call.function.name] if call.function and call.function.name else []
                    streamed += call.function.arguments or "" if call.function else ""
                finish = delta.finish_reason or finish
        assert names == [calls[0].function.name] and json.loads(streamed) == arguments and finish == "tool_calls"
    named = client.chat.completions.create(
        model=model, messages=QUESTION, tools=[WEATHER, LIGHTS], temperature=0, max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **NO_REASONING.get(model, {}),
    ).choices[0]
    assert [c.function.name for c in named.message.tool_calls or []][:1] == ["get_weather"]


@pytest.mark.parametrize("model", list(MODELS))
def test_the_tool_loop_goes_back_through_the_template(client: openai.OpenAI, model: str) -> None:
    kwargs = {"model": model, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
              "temperature": 0, "max_tokens": 300, **NO_REASONING.get(model, {})}
    reply = client.chat.completions.create(messages=QUESTION, **kwargs).choices[0].message
    assert reply.tool_calls
    answered = [*QUESTION, reply, {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "sunny"}]
    base = client.chat.completions.create(model=model, messages=QUESTION, tools=[WEATHER], max_tokens=1)
    after = client.chat.completions.create(model=model, messages=answered, tools=[WEATHER], max_tokens=1)
    assert base.usage is not None and after.usage is not None
    # The call and its result are in the prompt (the template rendered them), not dropped.
    assert after.usage.prompt_tokens > base.usage.prompt_tokens + len("sunny")


def test_auto_lets_the_model_answer_in_text(client: openai.OpenAI) -> None:
    # A random model practically never starts "<tool_call>" by itself: the lazy grammar
    # leaves its text alone, and the answer is content.
    result = client.chat.completions.create(
        model="qwen", messages=QUESTION, tools=[WEATHER], temperature=0, max_tokens=8,
    )
    plain = client.chat.completions.create(model="qwen", messages=QUESTION, temperature=0, max_tokens=8)
    choice = result.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason == "length" and "<tool_call>" not in choice.message.content
    assert result.usage is not None and plain.usage is not None
    assert result.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the template described the tools


@pytest.mark.parametrize("model", list(MODELS))
def test_tool_choice_none_still_describes_the_tools(client: openai.OpenAI, model: str) -> None:
    # "none": the model may not call, but the template still describes the tools (OpenAI and
    # llama-server --jinja: the same prompt as "auto", so a tool loop's last turn, often sent
    # with "none" to get an answer, keeps its prompt prefix), and the reply is text.
    kwargs = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 1}
    none = client.chat.completions.create(tools=[WEATHER], tool_choice="none", **kwargs)
    auto = client.chat.completions.create(tools=[WEATHER], **kwargs)
    plain = client.chat.completions.create(**kwargs)
    assert none.usage is not None and auto.usage is not None and plain.usage is not None
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens > plain.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"


def test_ollama_history_without_ids_renders_for_mistral(daemon) -> None:
    # Ollama's clients send calls and results without ids; Mistral's template requires ids
    # of 9 letters and digits on both: edged pairs them up.
    body = {"model": "mistral", "stream": False, "tools": [WEATHER], "options": {"num_predict": 1},
            "messages": [*QUESTION,
                         {"role": "assistant", "content": "",
                          "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                         {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]}
    response = httpx.post(f"http://127.0.0.1:{daemon.http_port}/api/chat", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["done"] is True


def test_responses_route_calls_in_the_models_syntax(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    response = client.responses.create(model="mistral", input="Weather in Paris?", tools=[tool],
                                       tool_choice="required", temperature=0, max_output_tokens=300,
                                       parallel_tool_calls=False)
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0].call_id)
    # Its output goes back as the next turn's input, through Mistral's template (9-character ids).
    follow = client.responses.create(
        model="mistral", tools=[tool], max_output_tokens=1,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
    )
    assert follow.status == "incomplete"


def test_a_control_token_marker_stays_in_the_reply(client: openai.OpenAI) -> None:
    # The grammar takes the control token for its text "[TOOL_CALLS]"; its text must stay in
    # the output for the reply to be read as calls (llama-server's preserved tokens).
    marker = len(_vocab()[0])  # the first token after the base vocabulary
    kwargs = {"model": "mistral_ctrl", "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required",
              "parallel_tool_calls": False, "temperature": 0, "logit_bias": {str(marker): 100}}
    first = client.chat.completions.create(max_tokens=1, **kwargs).choices[0]
    assert first.message.content == "[TOOL_CALLS]"
    choice = client.chat.completions.create(max_tokens=300, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert [c.function.name for c in choice.message.tool_calls or []][:1] == ["get_weather"]
    # Without tools the control token writes nothing, as before.
    plain = client.chat.completions.create(model="mistral_ctrl", messages=QUESTION, temperature=0, max_tokens=1,
                                           logit_bias={str(marker): 100}).choices[0]
    assert plain.message.content == ""


def test_responses_tool_choice_none_still_describes_the_tools(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    kwargs = {"model": "qwen", "input": "Weather in Paris?", "temperature": 0, "max_output_tokens": 1}
    none = client.responses.create(tools=[tool], tool_choice="none", **kwargs)
    auto = client.responses.create(tools=[tool], **kwargs)
    assert none.usage is not None and auto.usage is not None
    assert none.usage.input_tokens == auto.usage.input_tokens
    assert [item.type for item in none.output] == ["message"]


def test_auto_triggers_on_the_marker_token(client: openai.OpenAI) -> None:
    # With "auto" the grammar holds from the marker on: the control token [TOOL_CALLS] alone
    # triggers it (as in llama-server), and the grammar writes the "[" that follows.
    marker = len(_vocab()[0])
    choice = client.chat.completions.create(
        model="mistral_ctrl", messages=QUESTION, tools=[WEATHER], parallel_tool_calls=False, temperature=0,
        max_tokens=300, logit_bias={str(marker): 100},
    ).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert [c.function.name for c in choice.message.tool_calls or []] == ["get_weather"]


# Pydantic's shape for a tool taking a nested model: the model in the parameters' own $defs.
MOVE = {"type": "function", "function": {"name": "move_to", "parameters": {
    "type": "object", "properties": {"target": {"$ref": "#/$defs/Point"}}, "required": ["target"],
    "additionalProperties": False,
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                        "required": ["x", "y"], "additionalProperties": False}},
}}}


@pytest.mark.parametrize("model", ["qwen", "mistral", "ministral"])
def test_parameters_with_their_own_defs_are_enforced(client: openai.OpenAI, model: str) -> None:
    """A tool whose parameters reference their own `$defs` (every Pydantic model with a nested
    one) was a 400 for templates whose calls are JSON objects ("$defs not in ..."); its calls
    now hold to the nested schema."""
    for seed in (1, 2):
        choice = client.chat.completions.create(
            model=model, messages=QUESTION, tools=[MOVE], tool_choice="required", parallel_tool_calls=False, seed=seed,
            temperature=1.0,
            max_tokens=400, **NO_REASONING.get(model, {}),
        ).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        target = json.loads((choice.message.tool_calls or [])[0].function.arguments)["target"]
        assert set(target) == {"x", "y"} and all(isinstance(v, int) for v in target.values()), target
