"""Tool calling on /v1/chat/completions, as vLLM's server does it. The tools always reach the chat
template. tool_choice "none": the reply is text. A named function: the output is constrained (with
structured outputs) to that function's parameters and returned as its call. "required": the output
is constrained to a JSON list of {"name", "parameters"} calls, one or more. "auto" (the default when
tools are given): the model decides, and its calls are read back from the text by a parser, which
the server must be started with (--enable-auto-tool-choice --tool-call-parser hermes: calls written
as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, as Qwen's templates ask)."""

import json
import re
import uuid

PARSERS = ("hermes",)
# a call is "<tool_call>{json}</tool_call>"; the last may lack its closing tag (the model stopped there)
_HERMES_OPEN = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>|<tool_call>\s*(.*?)\s*\Z", re.S)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolChoice:
    """One request's tools and tool_choice, checked: what constrains its output (schema()) and how
    its text is read back into tool calls (read(), or stream() per streamed choice). Errors a client
    can make are ValueErrors (400s)."""

    def __init__(self, tools: list[dict] | None, tool_choice, parser: str | None = None):
        self.parameters = _check_tools(tools)   # name -> its parameters' JSON schema
        if tool_choice is None:
            tool_choice = "auto" if tools else "none"
        self.name = None
        if isinstance(tool_choice, dict):
            function = tool_choice.get("function")
            if tool_choice.get("type") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str):
                raise ValueError('tool_choice must be "none", "auto", "required" or '
                                 '{"type": "function", "function": {"name": ...}}')
            self.mode, self.name = "named", function["name"]
        elif tool_choice in ("none", "auto", "required"):
            self.mode = tool_choice
        else:
            raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, '
                             f"got {tool_choice!r}")
        if self.mode != "none" and not tools:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        if self.name is not None and self.name not in self.parameters:
            raise ValueError(f"Tool '{self.name}' has not been passed in `tools`.")
        if self.mode == "auto" and parser is None:
            raise ValueError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                             'to be set (or give tool_choice "none", "required" or a named function)')

    def schema(self) -> dict | None:
        """The JSON schema the output must follow, or None (free text)."""
        if self.mode == "named":
            return self.parameters[self.name]
        if self.mode == "required":
            # each tool's parameters nest inside the list's items, so their "$defs" (pydantic's
            # nested models, referenced as "#/$defs/...") move up to the list's root
            defs, calls = {}, []
            for name, parameters in self.parameters.items():
                parameters = dict(parameters)
                for key, schema in parameters.pop("$defs", {}).items():
                    if defs.setdefault(key, schema) != schema:
                        raise ValueError(f'tools define "$defs" entry {key!r} differently: give the '
                                         'definitions distinct names for tool_choice "required"')
                calls.append({"properties": {"name": {"type": "string", "enum": [name]},
                                             "parameters": parameters}, "required": ["name", "parameters"]})
            schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
            return {**schema, "$defs": defs} if defs else schema
        return None

    def read(self, text: str) -> tuple[str | None, list[dict]]:
        """A finished output's text as (content, tool calls). Text that does not parse stays content."""
        if self.mode == "named":
            return "", [_call(self.name, text)]
        if self.mode == "required":
            try:
                return "", [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                            for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):   # cut short (finish_reason "length")
                return text, []
        if self.mode == "auto":
            calls = []
            for closed, unclosed in _HERMES_CALL.findall(text):
                try:
                    call = json.loads(closed or unclosed)
                    arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
                    calls.append(_call(call["name"], arguments))
                except (ValueError, TypeError, KeyError, AttributeError):   # AttributeError: not an object
                    return text, []   # a malformed call: the text as it is, as vLLM's parsers answer
            if calls:
                return text[:text.index(_HERMES_OPEN)].rstrip() or None, calls
        return text, []

    def finish_reason(self, calls: list, finish_reason: str | None) -> str | None:
        """"tool_calls" when the model chose to call (required, auto) and stopped by itself; a named
        function keeps "stop", as OpenAI's."""
        return "tool_calls" if calls and self.mode != "named" and finish_reason == "stop" else finish_reason

    def stream(self) -> "ToolStream":
        return ToolStream(self)


class ToolStream:
    """One streamed choice's deltas under a ToolChoice. Free text streams as content; a named call
    streams its arguments as they come; "required" calls, and "auto" calls once "<tool_call>" begins,
    go out whole with the final delta."""

    def __init__(self, choice: ToolChoice):
        self.choice, self.text, self.calls = choice, "", []
        self.sent = 0   # characters of text already sent as content

    def delta(self, new: str, final: bool) -> dict:
        """The delta's fields (content and / or tool_calls) for the text added since the last."""
        mode = self.choice.mode
        self.text += new
        if mode == "none":
            return {"content": new}
        if mode == "named":   # the call's id, type and name go with its first arguments
            if not self.calls and (new or final):
                self.calls = [_call(self.choice.name, new)]
                return {"tool_calls": [{"index": 0, **self.calls[0]}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": new}}]} if new else {}
        if final:   # what read() makes content, less what was sent (always a prefix of it)
            content, self.calls = self.choice.read(self.text)
            rest = (content or "")[self.sent:]
            fields = {"content": rest} if rest else {}
            if self.calls:
                fields["tool_calls"] = [{"index": i, **c} for i, c in enumerate(self.calls)]
            return fields
        if mode == "required":
            return {}
        # auto: content up to where a call begins (or may begin: a tail that starts "<tool_call>"),
        # less trailing white space, which the content loses if a call follows
        safe = len(self.text[:_before_tag(self.text)].rstrip())
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return {"content": out} if out else {}


def _before_tag(text: str) -> int:
    """How much of text is surely content: up to "<tool_call>", or to a tail that may start it."""
    at = text.find(_HERMES_OPEN)
    if at >= 0:
        return at
    for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
        if _HERMES_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _check_tools(tools) -> dict[str, dict]:
    if tools is None:
        return {}
    out = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                             f'"parameters": {{...}}}}}}')
        parameters = function.get("parameters") or _EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[function["name"]] = parameters
    return out
