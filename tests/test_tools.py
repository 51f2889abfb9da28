"""Tool calling's request checks and its reading of outputs (nanovllm/serve/tools.py), without a
model: the server tests drive the named and "required" choices through a real model."""

import json

import pytest

from nanovllm.serve.tools import ToolChoice

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}   # no parameters: an empty object
TOOLS = [WEATHER, TIME]


def _arguments(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


def test_the_choices_and_what_they_constrain():
    assert ToolChoice(None, None).mode == "none" and ToolChoice(None, None).schema() is None
    assert ToolChoice(TOOLS, "none").schema() is None
    named = ToolChoice(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert named.schema() == WEATHER["function"]["parameters"]
    required = ToolChoice(TOOLS, "required").schema()
    assert required["type"] == "array" and required["minItems"] == 1
    names = [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert ToolChoice(TOOLS, None, parser="hermes").mode == "auto"   # tools given: "auto" by default


@pytest.mark.parametrize("tools, choice, fragment", [
    (TOOLS, None, "--enable-auto-tool-choice"),          # "auto" without a parser, as vLLM's server says
    (TOOLS, "auto", "--enable-auto-tool-choice"),
    (None, "required", "`tools` must be set"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "Tool 'nope' has not been passed"),
    (TOOLS, "sometimes", "tool_choice must be"),
    (TOOLS, {"function": {"name": "get_time"}}, "tool_choice must be"),
    ([{"type": "function"}], "required", r"tools\[0\] must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "required", "parameters must be"),
])
def test_bad_tool_requests_are_value_errors(tools, choice, fragment):
    with pytest.raises(ValueError, match=fragment):
        ToolChoice(tools, choice)


def test_reading_calls_back():
    named = ToolChoice(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    content, calls = named.read('{"city": "Paris"}')
    assert content == "" and calls[0]["function"]["name"] == "get_weather"
    assert _arguments(calls[0]) == {"city": "Paris"} and calls[0]["id"].startswith("chatcmpl-tool-")
    assert named.finish_reason(calls, "stop") == "stop"   # a forced function keeps "stop", as OpenAI's

    required = ToolChoice(TOOLS, "required")
    content, calls = required.read('[{"name": "get_time", "parameters": {}}, '
                                   '{"name": "get_weather", "parameters": {"city": "Köln"}}]')
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert calls[1]["function"]["arguments"] == '{"city": "Köln"}'   # not ASCII-escaped
    assert required.finish_reason(calls, "stop") == "tool_calls"
    assert required.finish_reason(calls, "length") == "length"
    assert required.read('[{"name": "get_ti') == ('[{"name": "get_ti', [])   # cut short: the text

    auto = ToolChoice(TOOLS, "auto", parser="hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = auto.read(text)
    assert content == "Let me check." and [_arguments(c) for c in calls] == [{"city": "Oslo"}, {}]
    assert auto.finish_reason(calls, "stop") == "tool_calls"
    assert auto.read("Just text.") == ("Just text.", [])
    assert auto.read("<tool_call>{not json}</tool_call>")[1] == []   # malformed: the text as it is
    assert auto.read('<tool_call>{"name": "get_time"}</tool_call>')[0] is None   # no text before: null
    for not_an_object in ("5", '"x"', "null", "[1]"):   # valid JSON, not a call: the text as it is
        text = f"<tool_call>{not_an_object}</tool_call>"
        assert auto.read(text) == (text, [])
    # the last call may lack its closing tag (the model stopped there), as vLLM's parser reads it
    content, calls = auto.read('Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "x"}}')
    assert content == "Checking." and _arguments(calls[0]) == {"city": "x"}


def test_required_moves_the_tools_definitions_to_the_list_s_root():
    # pydantic's nested models: "#/$defs/Place" must still resolve once the parameters are nested
    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    travel = {"type": "function", "function": {"name": "travel", "parameters": {
        "$defs": {"Place": place}, "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}}}}}
    schema = ToolChoice([travel, WEATHER], "required").schema()
    assert schema["$defs"] == {"Place": place}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert travel["function"]["parameters"]["$defs"] == {"Place": place}   # the request is not changed
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "$defs": {"Place": {"type": "string"}}, "type": "object"}}}
    with pytest.raises(ValueError, match="'Place' differently"):
        ToolChoice([travel, other], "required").schema()


def _stream(choice: ToolChoice, pieces: list[str]) -> list[dict]:
    stream = choice.stream()
    return [stream.delta(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]


def test_streamed_deltas():
    # auto: text streams as content, held back where it may begin a call (and white space before
    # one); calls go out whole at the end
    auto = ToolChoice(TOOLS, "auto", parser="hermes")
    pieces = ["Sure", ", one moment. <tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>',
              ""]
    deltas = _stream(auto, pieces)
    assert "".join(d.get("content", "") for d in deltas) == "Sure, one moment."
    assert deltas[1] == {"content": ", one moment."} and deltas[2] == deltas[3] == {}
    assert [c["function"]["name"] for c in deltas[-1]["tool_calls"]] == ["get_time"]
    assert deltas[-1]["tool_calls"][0]["index"] == 0
    # a "<" that turns out to be text is sent once it is clear
    deltas = _stream(auto, ["a <", "b", ""])
    assert "".join(d.get("content", "") for d in deltas) == "a <b"
    # named: the arguments stream as they come, under one call id
    named = ToolChoice(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    deltas = _stream(named, ['{"ci', 'ty": "Rome"}', ""])
    first = deltas[0]["tool_calls"][0]
    assert first["function"]["name"] == "get_weather" and first["id"].startswith("chatcmpl-tool-")
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if d) == '{"city": "Rome"}'
    assert "id" not in deltas[1]["tool_calls"][0]
    # required: nothing until the list is complete
    required = ToolChoice(TOOLS, "required")
    deltas = _stream(required, ['[{"name": "get_time", ', '"parameters": {}}]', ""])
    assert deltas[:2] == [{}, {}] and deltas[2]["tool_calls"][0]["function"]["name"] == "get_time"
    # none: plain content
    assert _stream(ToolChoice(TOOLS, "none"), ["a", "b"]) == [{"content": "a"}, {"content": "b"}]
