"""Chat templates of model families, for GGUF files that carry none (``tokenizer.chat_template``).

Base-model files (Google's Gemma 3 270M) ship without a template, yet the family's turn markup is
fixed and its tokens are in the vocabulary; llama.cpp falls back to the same built-in format.
Keyed by the GGUF ``general.architecture``.
"""

from __future__ import annotations

# Gemma 3's own template (tokenizer_config.json of google/gemma-3-*-it), text content only: a
# system message has no turn of its own and is folded into the first user turn; the assistant's
# role is spelled "model".  Gemma 1 and 2 use the same turns (their templates refuse a system
# message, which llama.cpp folds in the same way).
GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

# general.architecture -> (family name, template)
FAMILY_TEMPLATES: dict[str, tuple[str, str]] = {
    "gemma": ("gemma", GEMMA),
    "gemma2": ("gemma", GEMMA),
    "gemma3": ("gemma", GEMMA),
}


def family_template(architecture: str | None) -> tuple[str, str] | None:
    """(family name, Jinja chat template) for a GGUF ``general.architecture``; None when the
    family has no default template."""
    return FAMILY_TEMPLATES.get(architecture) if isinstance(architecture, str) else None
