"""Tools and tool turns into the prompt: through the chat template where it knows tools,
else written out for the ``generic`` format (a system prompt, JSON turns) while tools are
offered, and as plain text when they are not (so that a tool-free turn is answered in text,
not in an imitation of the JSON the model was never asked for)."""

from __future__ import annotations

import json
from typing import Any

from trillm.api.tools.base import ToolFormat
from trillm.api.tools.generic import Generic
from trillm.api.tools.spec import ToolSet


def renders_tools(template: str | None) -> bool:
    """Whether the chat template writes a ``tools`` list (and so its own tool turns) itself."""
    return "tools" in (template or "")


def has_tool_turns(messages: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def template_messages(
    template: str | None, messages: list[dict[str, Any]], tools: ToolSet | None, fmt: ToolFormat
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages to give ``apply_chat_template`` and its ``tools`` argument (None: none).
    A template that knows tools renders its own tool turns, with or without tools now."""
    if renders_tools(template) and (tools is None or not isinstance(fmt, Generic)):
        return messages, [f.openai() for f in tools.callable] if tools is not None else None
    if tools is None:
        return plain_messages(messages), None
    return generic_messages(messages, tools), None


def generic_messages(messages: list[dict[str, Any]], tools: ToolSet) -> list[dict[str, Any]]:
    """Tool turns as the generic format writes them: assistant turns as its JSON, tool results
    as user turns; the tools' description joins the system prompt."""
    names = _names(messages)
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": Generic.assistant_text(m["content"], m.get("tool_calls", []))})
        elif m["role"] == "tool":
            result = {"tool_call_id": m["tool_call_id"], "name": names.get(m["tool_call_id"]), "content": m["content"]}
            out.append({"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    described = Generic.system_prompt(tools)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
    else:
        out.insert(0, {"role": "system", "content": described})
    return out


def plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool turns as plain text any template can render: a call as a sentence of the assistant,
    a result as a user turn that says whose result it is."""
    names = _names(messages)
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            said = [m["content"]] if m["content"] else []
            said += [f"I called {c['function']['name']}({_arguments(c)})." for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(said)})
        elif m["role"] == "tool":
            name = names.get(m["tool_call_id"]) or "the tool"
            out.append({"role": "user", "content": f"{name} returned: {m['content']}"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def _names(messages: list[dict[str, Any]]) -> dict[str, str]:
    return {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}


def _arguments(call: dict[str, Any]) -> str:
    arguments = call["function"]["arguments"]
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
