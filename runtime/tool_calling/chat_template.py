"""The chat template of a request that has tools, and ``--chat-template``.

Many small models' own templates (SmolLM2's among them) know nothing of tools: they would drop the tool definitions,
assistant ``tool_calls`` and ``tool`` results from the prompt. For such requests a built-in tool-aware ChatML template
(the Hermes / Qwen2.5 convention the ``hermes`` parser reads) is used; ``--chat-template`` (a file or the template text)
overrides both. Conversations without tools keep the model's own template, so their prompts are unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Every literal is emitted by an expression: HF renders with trim_blocks/lstrip_blocks, which eat newlines after tags.
TOOL_CHATML = """
{%- macro system(text) -%}
  {{- '<|im_start|>system\n' + text }}
  {%- if tools -%}
    {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        '<args-json-object>}\n</tool_call>' }}
  {%- endif -%}
  {{- '<|im_end|>\n' }}
{%- endmacro -%}
{%- if messages and messages[0].role in ('system', 'developer') -%}
  {{- system(messages[0].content) }}
  {%- set rest = messages[1:] -%}
{%- else -%}
  {%- if tools %}{{ system('You are a helpful assistant.') }}{% endif -%}
  {%- set rest = messages -%}
{%- endif -%}
{%- for m in rest -%}
  {%- if m.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
    {%- if loop.last or loop.nextitem.role != 'tool' %}{{ '<|im_end|>\n' }}{% endif -%}
  {%- elif m.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' + (m.content or '') }}
    {%- for c in m.tool_calls or [] -%}
      {%- if m.content or not loop.first %}{{ '\n' }}{% endif -%}
      {%- set args = c.function.arguments if c.function.arguments is string else c.function.arguments | tojson -%}
      {{- '<tool_call>\n{"name": ' + (c.function.name | tojson) + ', "arguments": ' + args + '}\n</tool_call>' }}
    {%- endfor -%}
    {{- '<|im_end|>\n' }}
  {%- else -%}
    {{- '<|im_start|>' + ('system' if m.role == 'developer' else m.role) + '\n' + m.content + '<|im_end|>\n' }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}
"""


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's content when ``value`` names a file, else the value itself (vLLM's rule)."""
    if not value:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:   # a long inline template is no valid path
        pass
    return value


def uses_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def template_for(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 override: str | None) -> str | None:
    """The template to render with: the override, else the built-in one when tools are involved and the model's own
    template does not mention them, else None (the model's own)."""
    if override:
        return override
    own = getattr(tokenizer, "chat_template", None)
    if uses_tools(messages, tools) and (not isinstance(own, str) or "tool" not in own):
        return TOOL_CHATML
    return None


def render_chat_ids(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
                    add_generation_prompt: bool, override: str | None) -> list[int]:
    """Token ids of the conversation (ValueError / jinja's TemplateError when it cannot be rendered)."""
    template = template_for(tokenizer, messages, tools, override)
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template (give one with --chat-template)")
    ids = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template,
                                        add_generation_prompt=add_generation_prompt, tokenize=True,
                                        return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
