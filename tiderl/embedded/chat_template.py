"""The chat template of tiderl's embedded tiny model.

ChatML turns (`<|im_start|>role ... <|im_end|>`), tool calls in the Hermes/Qwen format
(`<tool_call>{json}</tool_call>`), tool responses grouped in one user turn as
`<tool_response>...</tool_response>` blocks. Tools are listed in the system turn by name and
argument names only: the tiny model has a short context, so full JSON schemas would not fit.
Real models bring their own template; tiderl uses whatever the tokenizer carries.
"""

from tiderl.models.startup import CHATML_TURNS
from tiderl.models.vision import IMAGE_PLACEHOLDER

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]

# Every newline the template emits is written as {{ nl }}; all tags strip the template's own
# whitespace ({%- -%}), so the rendering is the same under any Jinja whitespace settings
# (Hugging Face renders with trim_blocks and lstrip_blocks).
CHAT_TEMPLATE = (
    "{%- set nl = '\\n' -%}"
    "{%- set sys = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' -%}"
    "{%- if sys or tools -%}"
    "{{ '<|im_start|>system' + nl + sys }}"
    "{%- if tools -%}"
    "{{ nl + 'Tools:' }}"
    "{%- for tool in tools -%}"
    "{{ nl + '- ' + tool['function']['name'] + '(' }}"
    "{{- tool['function']['parameters']['properties'] | list | join(', ') -}}"
    "{{ ')' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>' + nl }}"
    "{%- endif -%}"
    + CHATML_TURNS
)

# The template of the tiny vision-language model (issue 31): CHAT_TEMPLATE where a message's
# content may also be a list of parts, `{"type": "image"}` rendering the processor's `<image>`
# placeholder (which the processor expands into the image's tokens) and `{"type": "text",
# "text": ...}` its text, in order.
_CONTENT_MACRO = (
    "{%- macro content(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- else -%}{%- for p in c -%}"
    "{%- if p['type'] == 'image' -%}{{ '" + IMAGE_PLACEHOLDER + "' }}"
    "{%- elif p['type'] == 'text' -%}{{ p['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
VLM_CHAT_TEMPLATE = _CONTENT_MACRO + CHAT_TEMPLATE.replace("m['content'] if m['content']", "content(m['content']) if m['content']").replace(
    "nl + m['content'] + nl", "nl + content(m['content']) + nl")
