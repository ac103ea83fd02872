"""Tools and tool turns into the prompt: through the chat template where it knows tools,
else written out for the ``generic`` format (a system prompt, JSON turns)."""

from __future__ import annotations

import json
from typing import Any

from trillm.api.tools.formats import Generic, ToolFormat, renders_tools
from trillm.api.tools.spec import ToolSet


def template_messages(
    template: str | None, messages: list[dict[str, Any]], tools: ToolSet | None, fmt: ToolFormat
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages to give ``apply_chat_template`` and its ``tools`` argument (None: none)."""
    if renders_tools(template) and not isinstance(fmt, Generic):
        return messages, [f.openai() for f in tools.callable] if tools is not None else None
    return generic_messages(messages, tools), None


def generic_messages(messages: list[dict[str, Any]], tools: ToolSet | None) -> list[dict[str, Any]]:
    """Tool turns as plain turns any template can render: assistant calls as the JSON the
    generic format writes, tool results as user turns; with ``tools``, their description
    joins the system prompt."""
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())}
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and (m.get("tool_calls") or tools is not None):
            out.append({"role": "assistant", "content": Generic.assistant_text(m["content"], m.get("tool_calls", []))})
        elif m["role"] == "tool":
            result = {"tool_call_id": m["tool_call_id"], "name": names.get(m["tool_call_id"]), "content": m["content"]}
            out.append({"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools is not None:
        described = Generic.system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out
