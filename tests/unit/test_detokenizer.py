"""IncrementalDetokenizer: DecodeStream (fast tokenizers) gives the text the Python window gives.

Two small in-memory tokenizers, no files: byte-level BPE (GPT-2, SmolLM2, Llama 3) and SentencePiece-style
byte fallback with a Metaspace decoder (Llama 2, Mistral), whose leading-space strip makes DecodeStream
refuse some windows (the Python window takes over for those).
"""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import kvserve.detokenizer as detokenizer
from kvserve.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello wörld 😀 ok", "the abc é ok 日本", "  spaces\n\nand ✓ marks "]


def _wrap(backend: Tokenizer) -> PreTrainedTokenizerFast:
    backend.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


def byte_level() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("Ġ", "w"), ("o", "k")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return _wrap(backend)


def byte_fallback() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0}
    vocab.update({f"<0x{b:02X}>": 1 + b for b in range(256)})
    for piece in ["▁", "▁Hello", "▁world", "ab", "c", "▁the", "é", "▁ok", "o", "k", "l", "▁w"]:
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return _wrap(backend)


def _run(tokenizer, prompt, ids, chunks, stops, include, skip) -> tuple[str, str | None, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, prompt, stops, include, skip)
    deltas, i = [], 0
    for size in chunks:
        chunk, i = ids[i:i + size], i + size
        finished = i >= len(ids)
        stopped = detok.add_tokens(chunk, finished)
        deltas.append(detok.take_delta(finished or stopped))
        if stopped or finished:
            break
    return detok.text, detok.stop_reason, deltas


@pytest.mark.parametrize("make", [byte_level, byte_fallback])
def test_decode_stream_gives_the_python_windows_text(make, monkeypatch):
    tokenizer = make()
    vocab_size = len(tokenizer)
    rng = random.Random(0)
    cases = []
    for _ in range(400):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 20))]
        if rng.random() < 0.6:
            ids = tokenizer.encode(rng.choice(TEXTS))[:rng.randrange(1, 40)] + ids[:rng.randrange(0, 3)]
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randrange(0, 7))]
        chunks = [rng.choice([1, 1, 2, 3]) for _ in ids]
        cases.append((prompt, ids, chunks, rng.choice([[], [" ok"], ["o", "ld"], ["😀"]]), rng.random() < 0.5,
                      rng.random() < 0.5))
    streamed = [_run(tokenizer, *case) for case in cases]
    monkeypatch.setattr(detokenizer, "rust_backend", lambda tokenizer: None)
    assert streamed == [_run(tokenizer, *case) for case in cases]


@pytest.mark.parametrize("make", [byte_level, byte_fallback])
def test_multibyte_characters_are_never_split_and_a_cut_one_is_flushed_at_the_end(make):
    tokenizer = make()
    ids = tokenizer.encode("a 😀 b")
    emoji_end = next(i for i in range(1, len(ids) + 1) if "😀" in tokenizer.decode(ids[:i]))
    detok = IncrementalDetokenizer(tokenizer, [], [])
    assert detok._stream is not None
    pieces = []
    for token_id in ids:
        detok.add_tokens([token_id])
        pieces.append(detok.take_delta(False))
    assert "".join(pieces) == "a 😀 b" and all("\ufffd" not in p for p in pieces)
    assert "😀" in pieces[emoji_end - 1]

    cut = IncrementalDetokenizer(tokenizer, [], [])
    cut.add_tokens(ids[:emoji_end - 1])
    assert "\ufffd" not in cut.text
    cut.add_tokens([], finished=True)
    assert cut.text.endswith("\ufffd")
