"""A chat request's `tools` and `tool_choice` -> how it runs (vLLM's semantics):

| tool_choice | the prompt | decoding | the output |
|---|---|---|---|
| "none" | tools rendered (as vLLM does) | free | content, never parsed |
| "auto" (default with tools) | tools rendered | free | the tool parser: calls and/or content |
| "required" | tools rendered | a JSON list (>= 1 item) of {"name": a tool, "parameters": its schema} | those calls |
| {"type": "function", ...} | tools rendered | a JSON object of that function's parameters schema | one call |

The constrained rows hold whatever the model's judgement: arguments always validate against the schema
(xgrammar, through SamplingParams.structured_outputs), written compactly (no optional whitespace, so a
small model cannot spend its tokens on blanks). Validation here is the 400s a client can fix.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, replace
from typing import Any

from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest, ChatTool
from kvserve.server.tool_parsers import NamedCallParser, RequiredCallsParser, TaggedJsonParser, ToolParser

# OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request's tools change: the template input, the constraint, the output parser."""

    mode: str | None = None
    """None (no tools), "none", "auto", "required" or "named"."""
    tools: list[dict[str, Any]] | None = None
    """The tools as the chat template gets them (OpenAI's objects, as HF's apply_chat_template takes them)."""
    parser: ToolParser | None = None
    """Reads calls out of the output; None: the output is content."""
    constraint: StructuredOutputsParams | None = None
    chat_template: str | None = None
    """A template that renders tools, for a model whose own template ignores them (SmolLM2's)."""
    max_calls: int | None = None
    """parallel_tool_calls false: 1."""

    def constrain(self, params: SamplingParams) -> SamplingParams:
        if self.constraint is None:
            return params
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {self.mode!r} constrains the output to tool calls; it cannot be "
                                "combined with response_format or structured_outputs", param="tool_choice")
        return params.clone(structured_outputs=self.constraint)

    def template_kwargs(self, kwargs: dict) -> dict:
        """apply_chat_template kwargs: the fallback template unless the request brought its own."""
        if self.chat_template is None or "chat_template" in kwargs:
            return kwargs
        return {**kwargs, "chat_template": self.chat_template}


NO_TOOLS = ToolPlan()


def plan_tools(request: ChatCompletionRequest, parser: TaggedJsonParser | None, auto_enabled: bool,
               model_template: str | None) -> ToolPlan:
    """Raises APIError 400 for what the client must change (unknown function, auto unavailable, ...).

    parser: the server's --tool-call-parser (None: none known for this model); model_template: the
    model's own chat template (to tell whether it renders tools)."""
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools: the request has none", param="tool_choice")
        return NO_TOOLS
    schemas = _check_tools(tools)
    choice = "auto" if choice is None else choice
    template = None
    if parser is not None and parser.chat_template and "tools" not in (model_template or ""):
        template = parser.chat_template
    plan = ToolPlan(tools=[t.model_dump(exclude_none=True) for t in tools], chat_template=template,
                    max_calls=1 if request.parallel_tool_calls is False else None)
    if choice == "none":
        return replace(plan, mode="none")
    if choice == "auto":
        if not auto_enabled:
            raise APIError(400, 'tool_choice "auto" needs the server started with --enable-auto-tool-choice',
                           param="tool_choice")
        if parser is None:
            raise APIError(400, 'tool_choice "auto" needs a tool call parser, and none is known for this '
                                "model's chat template: start the server with --tool-call-parser NAME",
                           param="tool_choice")
        return replace(plan, mode="auto", parser=parser)
    if choice == "required":
        return replace(plan, mode="required", parser=RequiredCallsParser(),
                       constraint=_constraint(required_schema(schemas, plan.max_calls)))
    name = choice.function.name
    if name not in schemas:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the request's tools "
                            f"({', '.join(schemas)})", param="tool_choice")
    return replace(plan, mode="named", parser=NamedCallParser(name), constraint=_constraint(schemas[name]))


def required_schema(schemas: dict[str, dict], max_calls: int | None = None) -> dict:
    """vLLM's schema for tool_choice "required": a list of calls, each one tool's name and parameters.

    Each tool's `$defs` move to the top level, where its `#/$defs/...` references then point."""
    defs: dict[str, Any] = {}
    items = []
    for name, schema in schemas.items():
        schema = copy.deepcopy(schema)
        for key, value in schema.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise APIError(400, f"tools define $defs {key!r} differently; tool_choice \"required\" needs "
                                    "one meaning per name", param="tools")
            defs[key] = value
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                       "parameters": schema},
                      "required": ["name", "parameters"], "additionalProperties": False})
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if max_calls is not None:
        array["maxItems"] = max_calls
    if defs:
        array["$defs"] = defs
    return array


def _constraint(schema: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def _check_tools(tools: list[ChatTool]) -> dict[str, dict]:
    """Each function's parameters schema by name; 400 for bad names, duplicates and malformed schemas."""
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not _NAME.match(name):
            raise APIError(400, f"tools[{i}].function.name {name!r} must be 1 to 64 letters, digits, "
                                "underscores or dashes", param="tools")
        if name in schemas:
            raise APIError(400, f"tools name the function {name!r} twice", param="tools")
        schema = tool.function.parameters
        if schema is None:
            schema = _NO_PARAMETERS
        elif schema.get("type", "object") != "object":
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema of type object, "
                                f"got type {schema.get('type')!r}", param="tools")
        problem = _schema_problem(schema)
        if problem:
            raise APIError(400, f"tools[{i}].function.parameters is not a valid JSON Schema: {problem}",
                           param="tools")
        schemas[name] = schema
    return schemas


def _schema_problem(node: Any, where: str = "") -> str | None:
    """The first obviously malformed keyword (what a client can fix); compiling the schema checks the rest."""
    if isinstance(node, bool):
        return None
    if not isinstance(node, dict):
        return f"{where or 'the schema'} must be an object"
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if any(not isinstance(k, str) or k not in _JSON_TYPES for k in kinds) or (isinstance(kind, list) and not kind):
        return f"{where}type {json.dumps(kind)} is not a JSON type"
    if "properties" in node and not isinstance(node["properties"], dict):
        return f"{where}properties must be an object"
    if "required" in node and (not isinstance(node["required"], list)
                               or not all(isinstance(r, str) for r in node["required"])):
        return f"{where}required must be a list of property names"
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        return f"{where}enum must be a non-empty list"
    if "$defs" in node and not isinstance(node["$defs"], dict):
        return f"{where}$defs must be an object"
    children = [(f"{where}properties.{k}.", v) for k, v in (node.get("properties") or {}).items()]
    children += [(f"{where}$defs.{k}.", v) for k, v in (node.get("$defs") or {}).items()]
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), dict):
            children.append((f"{where}{key}.", node[key]))
    for key in ("anyOf", "oneOf", "allOf"):
        if key in node:
            if not isinstance(node[key], list) or not node[key]:
                return f"{where}{key} must be a non-empty list"
            children += [(f"{where}{key}[{j}].", v) for j, v in enumerate(node[key])]
    for child_where, child in children:
        problem = _schema_problem(child, child_where)
        if problem:
            return problem
    return None
