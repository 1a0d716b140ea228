"""Request-body schemas for the OpenAPI document (`GET /openapi.json`).

The POST handlers read their bodies themselves (strict parsing, size limits, error shapes), so FastAPI
cannot see their models; each route declares its body here instead. The document then describes every
endpoint, which is what the fuzzing tests generate requests from.
"""
from __future__ import annotations

import copy

from pydantic import BaseModel


def request_body_schema(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose JSON body is `model` (its $refs inlined)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": _inline(schema, defs)}}}}


def _inline(node, defs: dict):
    # NOTE: none of the request models is recursive, so inlining terminates.
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        return _inline(copy.deepcopy(defs[name]), defs)
    return {key: _inline(value, defs) for key, value in node.items()}
