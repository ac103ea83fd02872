"""Tool fields of a chat request: ``tools``, ``tool_choice``, ``parallel_tool_calls`` (and
the legacy ``functions`` / ``function_call``, served as the same thing)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from trillm.api.schemas.base import RequestModel, invalid
from trillm.api.tools.spec import Function, ToolSet

MAX_TOOLS = 128


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$", description="letters, digits, `_`, `.`, `-`")
    description: str | None = Field(None, description="what the function does; shown to the model")
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments object")
    strict: bool | None = Field(None, description="accepted; arguments always match `parameters` when constrained")


class Tool(RequestModel):
    type: Literal["function"] = Field(description="only `function` tools")
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


class ToolFields(RequestModel):
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None,
        description=f"up to {MAX_TOOLS} functions the model may call; their `parameters` schemas constrain "
        "the arguments whenever a call is forced or has started",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description='`"auto"` (the default with tools): the model decides; `"required"`: at least one call, '
        'guaranteed by a grammar; `{"type": "function", "function": {"name"}}`: exactly that function; '
        '`"none"`: no calls (tools are not shown to the model)',
    )
    parallel_tool_calls: bool = Field(True, description="`false`: at most one call per turn")
    functions: Annotated[list[FunctionDefinition], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="legacy form of `tools` (not together with it)"
    )
    function_call: Literal["none", "auto"] | FunctionName | None = Field(
        None, description="legacy form of `tool_choice`"
    )

    @model_validator(mode="after")
    def _check_tools(self) -> ToolFields:
        if self.functions is not None and self.tools is not None:
            raise invalid("give either 'tools' or the legacy 'functions', not both", "functions")
        self.tool_set()
        return self

    def tool_set(self) -> ToolSet | None:
        """The tools and the choice, or None when no call may be made."""
        defs = [t.function for t in self.tools or ()] or list(self.functions or ())
        choice: Any = self.tool_choice if self.tool_choice is not None else self.function_call
        param = "tool_choice" if self.tool_choice is not None else "function_call"
        if isinstance(choice, NamedToolChoice):
            choice = choice.function.name
        elif isinstance(choice, FunctionName):
            choice = choice.name
        return tool_set_of(defs, choice, param, self.parallel_tool_calls, legacy=self.functions is not None)


def tool_set_of(
    defs: list[FunctionDefinition], choice: str | None, param: str, parallel: bool, legacy: bool = False
) -> ToolSet | None:
    """The functions and the choice (``"none"``, ``"auto"``, ``"required"`` or a function's name;
    None is ``"auto"``) as a ``ToolSet``, or None when no call may be made; ``param`` is the
    field that held the choice. Chat and the Responses API share it."""
    choice = choice or "auto"
    names = [d.name for d in defs]
    if len(set(names)) != len(names):
        raise invalid("function names must be unique", "tools")
    if not defs:
        if choice not in ("none", "auto"):
            raise invalid(f"{choice!r} needs 'tools'", param)
        return None
    if choice not in ("none", "auto", "required") and choice not in names:
        raise invalid(f"names no function in 'tools' ({choice!r})", param)
    if choice == "none":
        return None
    functions = tuple(
        Function(d.name, d.description or "", d.parameters or {"type": "object", "properties": {}}) for d in defs
    )
    return ToolSet(functions, choice, parallel, legacy=legacy)
