"""StructuredOutputsParams -> xgrammar grammars. xgrammar is imported on first use: it is only needed by
requests that ask for structured outputs, and its import costs about a second."""
from __future__ import annotations

import json

from kvserve.sampling_params import StructuredOutputsParams

# NOTE: OpenAI's json_object means "some JSON object", not any JSON value.
_JSON_OBJECT_SCHEMA = {"type": "object"}


def _xgr():
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - make install installs it
        raise ValueError("structured outputs need the xgrammar package (pip install --no-deps xgrammar "
                         "apache-tvm-ffi, or `make install`)") from None
    return xgrammar


def _schema(params: StructuredOutputsParams) -> str:
    schema = params.json if params.json is not None else _JSON_OBJECT_SCHEMA
    return schema if isinstance(schema, str) else json.dumps(schema)


def choice_ebnf(choices: list[str]) -> str:
    """One alternative per choice; JSON string escaping is valid EBNF literal escaping in xgrammar."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _json_kwargs(params: StructuredOutputsParams) -> dict:
    # NOTE: strict mode (xgrammar's default, as vLLM uses it): objects carry only the properties their
    # schema names, so whatever the model writes validates against the schema.
    return dict(any_whitespace=not params.disable_any_whitespace, strict_mode=True)


def build_grammar(params: StructuredOutputsParams):
    """The grammar of a spec, without a tokenizer (cheap: the front end's admission check).
    Raises ValueError naming the problem (an invalid schema, regex or EBNF, or an unsupported feature)."""
    xgr = _xgr()
    kind = params.kind
    if params.whitespace_pattern is not None:
        raise ValueError("structured_outputs.whitespace_pattern is not supported (xgrammar); "
                         "use disable_any_whitespace for compact JSON")
    try:
        if kind in ("json", "json_object"):
            return xgr.Grammar.from_json_schema(_schema(params), **_json_kwargs(params))
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(params.grammar)
        tag = params.structural_tag
        return xgr.Grammar.from_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
    except ValueError:
        raise
    except Exception as e:  # xgrammar reports problems as RuntimeError with a C++ source prefix
        raise ValueError(f"invalid structured_outputs.{kind}: {_clean(e)}") from None


def compile_grammar(compiler, params: StructuredOutputsParams):
    """The CompiledGrammar of a spec for `compiler`'s vocabulary (xgr.GrammarCompiler). Raises ValueError."""
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            return compiler.compile_json_schema(_schema(params), **_json_kwargs(params))
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_ebnf(params.choice))
        if kind == "grammar":
            return compiler.compile_grammar(params.grammar)
        tag = params.structural_tag
        return compiler.compile_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
    except Exception as e:
        raise ValueError(f"invalid structured_outputs.{kind}: {_clean(e)}") from None


def _clean(error: Exception) -> str:
    """xgrammar's messages start with '[time] /path/file.cc:line: '; keep what follows."""
    text = str(error).strip()
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition("] ")
        if ".cc:" in rest:
            rest = rest.split(": ", 1)[-1]
        text = rest
    return text.splitlines()[0] if text else type(error).__name__
