"""The embedded model's chat template, written to Qwen3's conventions.

Following Qwen3 means that every tool-call parser and reasoning splitter
written for Qwen models works on the tiny model unchanged: the tool list sits inside the system
turn, assistant tool calls are `<tool_call>` JSON blocks, tool results come back wrapped in
`<tool_response>` inside a user turn, and the assistant turns after the last user query carry a
`<think>` block (empty unless the message has reasoning).

Rendering is done by the renderer the server uses too (flashtree.checkpoint.chat_template), which
follows transformers' jinja conventions, so training text, served prompts and
`apply_chat_template` agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

_TOOLS_HEADER = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_FOOTER = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n'
)

# Every literal is emitted through {{ '...' }} and every tag strips the whitespace around it, so
# the layout of this source never leaks into the rendered text.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' -%}{{ messages[0].content + '\\n\\n' }}{%- endif -%}"
    "{{ '" + _TOOLS_HEADER + "' }}"
    "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '" + _TOOLS_FOOTER + "' }}"
    "{%- elif messages and messages[0].role == 'system' -%}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}"
    "{{ '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content or '' -%}"
    "{%- set reasoning = m.reasoning_content or '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{%- set reasoning = reasoning.strip('\\n') -%}{%- set content = content.lstrip('\\n') -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query -%}{{ '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif -%}"
    "{{ content }}"
    "{%- for call in (m.tool_calls or []) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if content or not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{%- if fn.arguments is string -%}{{ fn.arguments }}{%- else -%}{{ fn.arguments | tojson }}{%- endif -%}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class TemplateSource:
    """The three attributes `flashtree.checkpoint.render_chat` reads from a tokenizer, so corpus
    code can render with our template before any tokenizer file exists."""

    chat_template: str = CHAT_TEMPLATE
    bos_token: Optional[str] = None
    eos_token: Optional[str] = "<|im_end|>"


EMBEDDED = TemplateSource()
