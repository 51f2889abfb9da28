"""Chat messages as vLLM's LLM.chat takes them, checked and made ready for a chat template."""
import os

import jinja2


def parse_conversation(messages, where: str, content_format: str = "auto") -> list[dict]:
    """Check each message ({"role", "content"}, OpenAI style) and return copies the template can
    render. Content may be a string or OpenAI content parts ([{"type": "text", "text": ...}]);
    with content_format "auto" or "string" the text parts are joined with newlines, as vLLM does
    for templates that expect a string ("openai" passes the parts through). A null content (as an
    assistant message that carries tool_calls has) is rendered as "", as vLLM renders it."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"{where} must be a non-empty list of message dicts")
    parsed = []
    for i, message in enumerate(messages):
        name = f"{where}, message {i}"
        if not isinstance(message, dict):
            raise TypeError(f"{name} must be a dict with 'role' and 'content', got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"{name} has no 'role' (a string such as 'user'): {message!r:.80}")
        message = dict(message)
        content = message.get("content")
        if content is None:
            if "content" not in message and not message.get("tool_calls"):
                raise ValueError(f"{name} (role {message['role']!r}) has no 'content'")
            message["content"] = ""
        elif isinstance(content, (list, tuple)) and content_format != "openai":
            message["content"] = "\n".join(text_parts(content, name))
        elif not isinstance(content, (str, list, tuple)):
            raise ValueError(f"{name}: 'content' must be a string or a list of content parts, "
                             f"got {type(content).__name__}")
        parsed.append(message)
    return parsed


def text_parts(parts, name: str) -> list[str]:
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{name}: content part {j} (type 'text') needs a 'text' string")
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{name}: content part of type {kind!r} is not supported (text-only models: "
                             "use {'type': 'text', 'text': ...})")
    return texts


def load_chat_template(chat_template: str | None) -> str | None:
    """A template string, or the path of a file that holds one (as vLLM's --chat-template takes)."""
    if chat_template is None:
        return None
    if not isinstance(chat_template, str):
        raise TypeError("chat_template must be a Jinja template string or a file path, "
                        f"got {type(chat_template).__name__}")
    if "{" not in chat_template and os.path.isfile(chat_template):
        with open(chat_template) as f:
            return f.read()
    return chat_template


def render_chat(tokenizer, conversation, where: str = "conversation 0", *, chat_template: str | None = None,
                content_format: str = "auto", add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                chat_template_kwargs: dict | None = None) -> str:
    """One conversation as the prompt text its chat template writes (LLM.chat and the server).
    chat_template: a template already loaded (None: the tokenizer's)."""
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("chat needs a tokenizer with a chat template (tokenizer.chat_template) or "
                         "chat_template=...; this model folder has none: use generate with a "
                         "formatted prompt")
    if content_format not in ("auto", "string", "openai"):
        raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', "
                         f"got {content_format!r}")
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(set(extra) & {"conversation", "messages", "tokenize", "return_dict", "return_tensors"})
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: the "
                         "conversation and the tokenization are the chat call's own")
    # the template's variables; chat_template_kwargs override the defaults, as in vLLM
    options = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                   **({"chat_template": chat_template} if chat_template else {}),
                   **({"tools": tools} if tools else {}))
    options.update(extra)
    if options["continue_final_message"] and options["add_generation_prompt"]:
        raise ValueError("continue_final_message=True continues the last message, so it needs "
                         "add_generation_prompt=False")
    try:
        return tokenizer.apply_chat_template(parse_conversation(conversation, where, content_format),
                                             tokenize=False, **options)
    except jinja2.TemplateError as e:   # the template refused the conversation (raise_exception) or is broken
        raise ValueError(f"{where}: the chat template failed: {e}") from None


def chat_prompts(tokenizer, messages, *, chat_template: str | None = None, content_format: str = "auto",
                 add_generation_prompt: bool = True, continue_final_message: bool = False,
                 tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[dict]:
    """LLM.chat's `messages` (one conversation, a list of message dicts, or a list of them) as
    TokensPrompts: each rendered with the chat template (a string or a file: see load_chat_template)
    and encoded as the template wrote it."""
    template = load_chat_template(chat_template)
    if not isinstance(messages, (list, tuple)):
        raise TypeError("messages must be a conversation (a list of message dicts) "
                        "or a list of conversations")
    # [] is no conversations, as in vLLM: generate([]) answers []
    conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
    prompts = [render_chat(tokenizer, c, f"conversation {i}", chat_template=template,
                           content_format=content_format, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, tools=tools,
                           chat_template_kwargs=chat_template_kwargs)
               for i, c in enumerate(conversations)]
    # The template already writes any BOS it wants; encoding must not add another.
    return [{"prompt_token_ids": tokenizer.encode(p, add_special_tokens=False), "prompt": p} for p in prompts]
