"""Default sampling parameters, vLLM's way: `--generation-config auto|vllm|PATH` and
`--override-generation-config '<json>'`. They fill every sampling field a request leaves unset; what a
request sets always wins.

- auto: the model's `generation_config.json` (temperature, top_p, top_k, min_p, repetition_penalty,
  max_new_tokens); for the built-in SmolLM2-135M-Instruct, BUILTIN_DEFAULTS (it ships no such file).
- vllm: none (the API's own defaults: temperature 1.0, no length limit but max_model_len).
- PATH: a folder holding generation_config.json, or the file itself.
"""
from __future__ import annotations

import json
import os
from typing import Any

# NOTE: with the model card's example (temperature 0.2, top_p 0.9, 50 new tokens) the quick start's question is
# sometimes answered "L'Étoile, la Marseillaise, la femme, la femme...": the first tokens "The" and "L" are
# nearly tied. Cooler, narrower sampling plus a light repetition penalty keeps to "The capital of France is
# Paris." (tests/server/test_generation_config.py holds it to 9 of 10 seeded runs through the server).
BUILTIN_DEFAULTS: dict[str, Any] = {"temperature": 0.1, "top_p": 0.5, "repetition_penalty": 1.1, "max_tokens": 50}

# generation_config.json key -> SamplingParams field
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def parse_override(value: str | dict | None) -> dict[str, Any]:
    """--override-generation-config: a JSON object of generation_config keys (or SamplingParams names)."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--override-generation-config must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config must be a JSON object")
    return _translate(value, "--override-generation-config", strict=True)


def _translate(config: dict, what: str, strict: bool) -> dict[str, Any]:
    out = {}
    for key, val in config.items():
        field = _KEYS.get(key) or (key if key in _KEYS.values() else None)
        if field is None:
            if strict:
                raise ValueError(f"{what}: unknown key {key!r}; known: {', '.join(sorted(_KEYS))}")
            continue
        if val is not None:
            out[field] = val
    return out


def _read(path: str) -> dict[str, Any]:
    file = os.path.join(path, "generation_config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return _translate(json.load(f), file, strict=False)


def default_sampling(mode: str, model: str | None, override: str | dict | None) -> dict[str, Any]:
    """The SamplingParams keyword defaults in effect (validated: a bad value raises ValueError)."""
    from kvserve.sampling_params import SamplingParams

    if mode == "vllm":
        defaults: dict[str, Any] = {}
    elif mode == "auto":
        if model is None or _is_builtin(model):
            defaults = dict(BUILTIN_DEFAULTS)
        elif os.path.isdir(model):
            defaults = _read(model)
        else:
            defaults = {}  # a GGUF file carries no sampling defaults we read
    else:
        if not os.path.exists(mode):
            raise ValueError(f"--generation-config: {mode!r} is not auto, vllm or an existing path")
        defaults = _read(mode)
    defaults.update(parse_override(override))
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"default sampling parameters {defaults}: {e}") from None
    return defaults


def _is_builtin(model: str) -> bool:
    from kvserve.model_loader.gguf_loader import builtin_model_path

    try:
        return model.endswith(".gguf") and os.path.samefile(model, builtin_model_path())
    except (OSError, ValueError):
        return False
