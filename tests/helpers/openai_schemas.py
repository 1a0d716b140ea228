"""OpenAI's OpenAPI schemas for the server tests (`check_schema`): the repository does not ship the document,
so it is read from $KVSERVE_OPENAPI_SPEC or ../shared/specs/openai-openapi.yml beside the repository, and a
test whose only unchecked part is a schema check is reported skipped, with the reason, when it is absent.
Registered as a pytest plugin (its fixtures and hook) in tests/conftest.py."""
from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import pytest

SPEC_ENV = "KVSERVE_OPENAPI_SPEC"
DEFAULT_SPEC = Path(__file__).resolve().parents[2].parent / "shared" / "specs" / "openai-openapi.yml"


def openai_spec_path() -> tuple[Path | None, str]:
    """(the OpenAI OpenAPI document's path, "") when there is one, else (None, why not). $KVSERVE_OPENAPI_SPEC
    if set, else ../shared/specs/openai-openapi.yml beside the repository; the repository does not ship it."""
    configured = os.environ.get(SPEC_ENV)
    path = Path(configured) if configured else DEFAULT_SPEC
    if path.is_file():
        return path, ""
    where = f"{SPEC_ENV}={configured} is not a file" if configured else f"{SPEC_ENV} is unset and {DEFAULT_SPEC} absent"
    return None, (f"OpenAI's OpenAPI document is not here ({where}); the repository does not ship it: put "
                  f"openai-openapi.yml there or point {SPEC_ENV} at it")


def _openapi_to_jsonschema(node) -> None:
    """OpenAPI 3.0's `nullable: true` (still used in places of this 3.1 document) -> JSON Schema."""
    if isinstance(node, list):
        for item in node:
            _openapi_to_jsonschema(item)
        return
    if not isinstance(node, dict):
        return
    for value in node.values():
        _openapi_to_jsonschema(value)
    if node.pop("nullable", False):
        if isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
            if "enum" in node:
                node["enum"] = [*node["enum"], None]
        else:
            inner = dict(node)
            node.clear()
            node["anyOf"] = [inner, {"type": "null"}]


@functools.cache
def _load_document(path: Path) -> dict:
    import yaml

    spec = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    _openapi_to_jsonschema(spec)
    schemas = spec["components"]["schemas"]
    # NOTE: the spec uses one schema for completion bodies and stream chunks, but a chunk of a choice that
    # is still running carries finish_reason null (as OpenAI's API sends it); allow that for chunks only.
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {
        "anyOf": [chunk["properties"]["choices"]["items"]["properties"]["finish_reason"], {"type": "null"}]}
    schemas["CreateCompletionStreamChunk"] = chunk
    return spec


class OpenAISchemas:
    """Validators of OpenAI's component schemas (from its OpenAPI document, with `nullable` converted and a
    CreateCompletionStreamChunk added), or, without the document, the reason there are none."""

    def __init__(self, patch=None):
        """patch(schemas): changes a copy of the document's component schemas (a test's own variant)."""
        path, self.missing = openai_spec_path()
        self._registry = None
        self._validators: dict = {}
        if path is None:
            return
        import referencing
        import referencing.jsonschema

        spec = _load_document(path)
        if patch is not None:
            spec = copy.deepcopy(spec)
            patch(spec["components"]["schemas"])
        resource = referencing.Resource.from_contents(spec, default_specification=referencing.jsonschema.DRAFT202012)
        self._registry = referencing.Registry().with_resource("openai.yml", resource)

    @property
    def available(self) -> bool:
        return self._registry is not None

    def validate(self, name: str, instance) -> None:
        import jsonschema

        if name not in self._validators:
            self._validators[name] = jsonschema.Draft202012Validator(
                {"$ref": f"openai.yml#/components/schemas/{name}"}, registry=self._registry)
        self._validators[name].validate(instance)

    def checker(self, node: pytest.Item) -> "SchemaChecker":
        return SchemaChecker(self, node)


_NOT_CHECKED = pytest.StashKey[list]()


class SchemaChecker:
    """check(name, instance) raises jsonschema.ValidationError unless `instance` matches OpenAI's component
    schema `name`. Without the document the check is recorded as not done, and the test, once everything
    else in it has passed, is reported skipped with the reason (see pytest_runtest_call)."""

    def __init__(self, schemas: OpenAISchemas, node: pytest.Item):
        self.schemas, self.node = schemas, node

    def __call__(self, name: str, instance) -> None:
        if self._available(name):
            self.schemas.validate(name, instance)

    def rejects(self, name: str, instance) -> None:
        """Asserts that `instance` does NOT match schema `name`."""
        import jsonschema

        if self._available(name):
            with pytest.raises(jsonschema.ValidationError):
                self.schemas.validate(name, instance)

    def _available(self, name: str) -> bool:
        if self.schemas.available:
            return True
        self.node.stash.setdefault(_NOT_CHECKED, []).append(name)
        return False


@pytest.fixture(scope="session")
def openai_schemas() -> OpenAISchemas:
    return OpenAISchemas()


@pytest.fixture
def check_schema(openai_schemas, request) -> SchemaChecker:
    """check_schema(component_name, instance) raises jsonschema.ValidationError on a mismatch."""
    return openai_schemas.checker(request.node)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield  # NOTE: a test that failed raises here, and is reported failed
    not_checked = item.stash.get(_NOT_CHECKED, None)
    if not_checked:
        pytest.skip(f"{len(not_checked)} schema check(s) not done ({', '.join(sorted(set(not_checked)))}), "
                    f"everything else passed: {openai_spec_path()[1]}")
    return result
