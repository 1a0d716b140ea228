"""The GGUF tokenizer cache (model_loader/tokenizer_cache.py): a second load reads the cached tokenizer.json and
tokenizes and decodes exactly as the GGUF-built tokenizer does; an entry of another file, or of this file before
it changed, is never used; a damaged entry is rebuilt."""
from __future__ import annotations

import os
import shutil

import pytest

from kvserve.model_loader import gguf_loader
from kvserve.model_loader.tokenizer_cache import tokenizer_entry
from tests.helpers.checkpoints import builtin_tokenizer

TEXTS = ["Hello, world! How are you today?", "The year 2024 had 366 days.", "x   42 and  7", "naïve café — ünïcode ✓ 😀",
         "def f(x):\n    return x * 2\n", "  leading spaces and trailing ", "<|im_start|>user\nhi<|im_end|>\n", ""]


@pytest.fixture
def gguf_copy(tmp_path, monkeypatch, request):
    """A private copy of the built-in GGUF, a private cache dir, and the list of GGUF tokenizer builds. Only a
    test that asks for it (`request.param`) builds for real; elsewhere a "build" hands back the session's built-in
    tokenizer (seconds saved per build)."""
    try:
        source = gguf_loader.builtin_model_path()
    except ModuleNotFoundError as exc:
        pytest.skip(str(exc))
    reference = builtin_tokenizer()  # read before the cache dir changes (once a session)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "model.gguf")
    shutil.copyfile(source, path)
    builds = []
    real = gguf_loader._build_gguf_tokenizer

    def counting(p, reader):
        builds.append(p)
        return real(p, reader) if getattr(request, "param", False) else reference

    monkeypatch.setattr(gguf_loader, "_build_gguf_tokenizer", counting)
    return path, builds, reference


@pytest.mark.parametrize("gguf_copy", [True], indirect=True, ids=["real-build"])
def test_cached_tokenizer_equals_the_gguf_built_one(gguf_copy):
    path, builds, reference = gguf_copy
    built = gguf_loader.load_gguf_tokenizer(path)
    assert builds == [path]
    cached = gguf_loader.load_gguf_tokenizer(path)
    assert builds == [path]  # the second load read the cache
    assert type(cached) is type(built)
    for tok in (built, cached):
        for text in TEXTS:
            ids = reference(text).input_ids
            assert tok(text).input_ids == ids, text
            assert tok.decode(ids) == reference.decode(ids), text
            assert tok.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template", "all_special_tokens"):
        assert getattr(cached, name) == getattr(built, name), name
    assert len(cached) == len(built)
    assert cached.added_tokens_decoder == built.added_tokens_decoder
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert cached.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        built.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_an_entry_of_another_file_or_an_older_version_is_not_used(gguf_copy, tmp_path):
    path, builds, _ = gguf_copy
    gguf_loader.load_gguf_tokenizer(path)
    other = str(tmp_path / "other.gguf")
    shutil.copyfile(path, other)  # the same bytes at another path: its own entry
    gguf_loader.load_gguf_tokenizer(other)
    assert builds == [path, other]
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file was rewritten
    entry, _ = tokenizer_entry(path, gguf_loader.__file__)
    assert not os.path.isdir(entry)
    gguf_loader.load_gguf_tokenizer(path)
    assert builds == [path, other, path]
    assert os.path.isdir(entry)


def test_an_entry_naming_another_source_or_damaged_is_rebuilt(gguf_copy, caplog):
    path, builds, reference = gguf_copy
    gguf_loader.load_gguf_tokenizer(path)
    entry, _ = tokenizer_entry(path, gguf_loader.__file__)
    with open(os.path.join(entry, "source.json"), "w") as f:
        f.write('{"path": "/elsewhere.gguf"}')  # an entry whose recorded source is not this file
    gguf_loader.load_gguf_tokenizer(path)
    assert len(builds) == 2
    with open(os.path.join(entry, "tokenizer.json"), "w") as f:
        f.write("{ not json")
    tok = gguf_loader.load_gguf_tokenizer(path)
    assert len(builds) == 3 and "ignoring the cached tokenizer" in caplog.text
    assert tok("12345").input_ids == reference("12345").input_ids
    assert gguf_loader.load_gguf_tokenizer(path)("hi").input_ids == tok("hi").input_ids and len(builds) == 3
