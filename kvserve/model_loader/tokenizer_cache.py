"""Tokenizers built from a GGUF file, kept as `tokenizer.json` (+ its config and chat template) under
`<envs.cache_dir()>/tokenizers/`, so that a second start loads the `tokenizers` JSON (well under a second)
instead of converting the GGUF's vocabulary and merges again (seconds: transformers parses the file itself).

An entry is named by a digest of the file's absolute path, size and modification time, the transformers and
tokenizers versions and the source of the code that builds the tokenizer: a rewritten or replaced file, an
upgraded library or a changed conversion each miss and build afresh. Entries are written to a temporary folder
and renamed into place, so a reader never sees half of one; a cache that cannot be written only costs the
next start its time.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import kvserve.envs as envs

logger = logging.getLogger(__name__)

_SOURCE_FILE = "source.json"
MAX_ENTRIES = 32
"""Entries kept (the newest): every GGUF file ever served has one, test files in temporary folders too."""


def tokenizer_entry(path: str, builder_file: str) -> tuple[str, dict[str, Any]]:
    """The cache folder for the tokenizer of the file at `path` built by the code in `builder_file`, and
    what names it (written beside the tokenizer and checked on load)."""
    import tokenizers
    import transformers

    stat = os.stat(path)
    with open(builder_file, "rb") as f:
        builder = hashlib.sha256(f.read()).hexdigest()
    source = {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "transformers": transformers.__version__, "tokenizers": tokenizers.__version__, "builder": builder}
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(envs.cache_dir(), "tokenizers", digest), source


def load_or_build(path: str, builder_file: str, build: Callable[[], Any]):
    """The tokenizer cached for `path`, or `build()`'s, which is then cached."""
    entry, source = tokenizer_entry(path, builder_file)
    cached = _load(entry, source)
    if cached is not None:
        return cached
    tokenizer = build()
    try:
        _save(tokenizer, entry, source)
    except Exception as e:  # the cache is an optimisation: a start never fails for it
        logger.warning("could not cache the tokenizer of %s in %s (the next start builds it again): %s",
                       path, entry, e)
    return tokenizer


def _load(entry: str, source: dict[str, Any]):
    try:
        with open(os.path.join(entry, _SOURCE_FILE), encoding="utf-8") as f:
            if json.load(f) != source:
                return None
    except (OSError, ValueError):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(entry, local_files_only=True)
    except Exception as e:  # a damaged entry: build afresh (and overwrite it)
        logger.warning("ignoring the cached tokenizer in %s: %s", entry, e)
        return None


def _save(tokenizer, entry: str, source: dict[str, Any]) -> None:
    parent = os.path.dirname(entry)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=parent)
    try:
        tokenizer.save_pretrained(staging)
        with open(os.path.join(staging, _SOURCE_FILE), "w", encoding="utf-8") as f:
            json.dump(source, f)
        shutil.rmtree(entry, ignore_errors=True)  # a damaged or half-deleted entry
        os.rename(staging, entry)
        _prune(parent)
    except OSError:
        if not os.path.isdir(entry):
            raise
        # another process renamed its own copy into place first: theirs serves as well as ours
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _prune(parent: str) -> None:
    """Drop the oldest entries past MAX_ENTRIES."""
    entries = [e for e in os.scandir(parent) if e.is_dir() and not e.name.startswith(".")]
    entries.sort(key=lambda e: e.stat().st_mtime, reverse=True)
    for old in entries[MAX_ENTRIES:]:
        shutil.rmtree(old.path, ignore_errors=True)
