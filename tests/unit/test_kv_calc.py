"""`kvserve kv-calc` and `parse_size`: exact byte counts for well-known model shapes."""

from __future__ import annotations

import json
import re

import pytest
from transformers import LlamaConfig

from kvserve.cli.kv_calc import kv_bytes_per_token
from kvserve.utils.sizes import format_size, parse_size
from tests.helpers.kv_calc import kv_calc_exit as _cli
from tests.helpers.kv_calc import kv_calc_json as _cli_json

LLAMA3_70B = dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8)
LLAMA3_8B = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
# GPT-3 175B shape, written without num_key_value_heads so the MHA fallback is exercised.
GPT3_175B = dict(num_hidden_layers=96, hidden_size=12288, num_attention_heads=96, max_position_embeddings=2048)


def _write_config(folder, **fields) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return str(folder)


# --------------------------------------------------------------------------- kv_bytes_per_token


@pytest.mark.parametrize(
    ("shape", "expected"),
    [(LLAMA3_70B, 327_680), (LLAMA3_8B, 131_072), (GPT3_175B, 4_718_592)],
    ids=["llama3-70b", "llama3-8b", "gpt3-175b-mha"],
)
def test_kv_bytes_per_token_fp16(shape, expected):
    assert kv_bytes_per_token(shape, 2) == expected


def test_kv_bytes_per_token_fallbacks():
    # MQA: one KV head.
    assert kv_bytes_per_token(dict(LLAMA3_8B, num_key_value_heads=1), 2) == 2 * 32 * 1 * 128 * 2
    # An explicit head_dim wins over hidden_size // heads (e.g. Gemma, Qwen3).
    assert kv_bytes_per_token(dict(LLAMA3_8B, head_dim=256), 1) == 2 * 32 * 8 * 256
    # A transformers config object works as well as a dict.
    assert kv_bytes_per_token(LlamaConfig(**LLAMA3_70B), 2) == 327_680


def test_kv_bytes_per_token_errors():
    with pytest.raises(ValueError, match="'num_hidden_layers' must be a positive integer, got None"):
        kv_bytes_per_token({"hidden_size": 64, "num_attention_heads": 4}, 2)
    with pytest.raises(ValueError, match="dtype_bytes must be a positive integer, got 0"):
        kv_bytes_per_token(LLAMA3_8B, 0)


# --------------------------------------------------------------------------- the CLI


def test_cli_llama3_70b_from_save_pretrained(tmp_path, capsys):
    LlamaConfig(**LLAMA3_70B, max_position_embeddings=8192, dtype="bfloat16").save_pretrained(tmp_path / "70b")
    report = _cli_json(capsys, "--model", str(tmp_path / "70b"))
    assert report["kv_dtype"] == "bfloat16"  # auto: the config's dtype
    assert report["kv_bytes_per_token"] == 327_680
    assert (report["num_layers"], report["num_kv_heads"], report["head_dim"]) == (80, 8, 128)
    assert report["context"] == 8192  # default: max_position_embeddings
    assert report["kv_bytes_total"] == 327_680 * 8192
    assert report["kv_gib_total"] == 2.5


def test_cli_llama3_8b_config_json_path(tmp_path, capsys):
    folder = _write_config(tmp_path / "8b", **LLAMA3_8B, max_position_embeddings=8192, torch_dtype="float32")
    report = _cli_json(capsys, "--model", f"{folder}/config.json", "--kv-dtype", "float16", "--batch", "4", "--context", "1000")
    assert report["kv_bytes_per_token"] == 131_072
    assert report["kv_bytes_total"] == 131_072 * 1000 * 4


def test_cli_gpt3_mha_defaults_to_float16(tmp_path, capsys):
    folder = _write_config(tmp_path / "gpt3", **GPT3_175B)
    report = _cli_json(capsys, "--model", folder)
    assert report["kv_dtype"] == "float16"  # no dtype in the config
    assert report["num_kv_heads"] == 96
    assert report["kv_bytes_per_token"] == 4_718_592
    assert report["kv_bytes_per_sequence"] == 4_718_592 * 2048  # 9 GiB per 2k-token sequence


def test_cli_builtin_gguf_float32(capsys):
    from kvserve.model_loader.gguf_loader import builtin_model_path

    try:
        path = builtin_model_path()
    except ModuleNotFoundError as exc:
        pytest.skip(str(exc))
    report = _cli_json(capsys, "--model", path, "--kv-dtype", "float32", "--memory", "2GiB")
    assert report["kv_bytes_per_token"] == 46_080
    assert report["context"] == 8192
    assert report["max_sequences_in_memory"] == 5  # 2 GiB // (46,080 × 8,192 = 360 MiB)


def test_cli_memory_fit_count(tmp_path, capsys):
    folder = _write_config(tmp_path / "8b", **LLAMA3_8B, max_position_embeddings=8192)
    # 80 GB minus 16 GB of weights: 64e9 // (131,072 × 4,096 = 512 MiB) = 119 sequences.
    report = _cli_json(capsys, "--model", folder, "--context", "4096", "--memory", "64GB", "--batch", "128")
    assert report["memory_bytes"] == 64 * 10**9
    assert report["max_sequences_in_memory"] == 119
    assert report["max_tokens_in_memory"] == 64 * 10**9 // 131_072
    assert report["batch_fits"] is False
    # Exactly enough memory for the batch still fits.
    report = _cli_json(capsys, "--model", folder, "--context", "4096", "--memory", "2GiB", "--batch", "4")
    assert (report["max_sequences_in_memory"], report["batch_fits"]) == (4, True)


def test_cli_human_readable_report(tmp_path, capsys):
    folder = _write_config(tmp_path / "70b", **LLAMA3_70B, max_position_embeddings=8192)
    assert _cli("--model", folder, "--memory", "80GB") == 0
    out = capsys.readouterr().out
    assert "80 layers, 64 heads, 8 KV heads (GQA), head_dim 128" in out
    assert "327,680 bytes" in out
    assert "2.500 GiB" in out
    assert "29 sequences of 8,192 tokens" in out  # 80e9 // 2,684,354,560


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "{tmp}/missing"], "model not found: {tmp}/missing"),
        (["--model", "{tmp}"], "has no config.json"),
        (["--model", "{cfg}", "--context", "0"], "--context must be a positive integer, got 0"),
        (["--model", "{cfg}", "--batch", "-2"], "--batch must be a positive integer, got -2"),
        (["--model", "{cfg}", "--memory", "lots"], "invalid size 'lots'"),
        (["--model", "{cfg}", "--memory", "0GiB"], "--memory must be positive"),
        (["--model", "{bad_json}"], "is not valid JSON"),
    ],
)
def test_cli_user_errors_exit_2(tmp_path, capsys, argv, message):
    cfg = _write_config(tmp_path / "model", **LLAMA3_8B, max_position_embeddings=8192)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    subst = dict(tmp=tmp_path, cfg=cfg, bad_json=bad_json)
    assert _cli(*[a.format(**subst) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvserve kv-calc: error: ")
    assert message.format(**subst) in captured.err


def test_cli_without_a_context_reports_per_token_figures(tmp_path, capsys):
    folder = _write_config(tmp_path / "m", **LLAMA3_8B)
    assert _cli("--model", folder, "--memory", "16GiB") == 0
    out = capsys.readouterr().out
    assert "KV per token     131,072 bytes" in out and "pass --context for it" in out
    assert "131,072 tokens in all" in out
    report = _cli_json(capsys, "--num-layers", "32", "--num-kv-heads", "8", "--head-dim", "128")
    assert report["kv_bytes_per_token"] == 131_072 and report["context"] is None
    assert report["kv_bytes_per_sequence"] is None


# --------------------------------------------------------------------------- shape flags, GPT-2/Falcon keys


def test_cli_shape_from_flags_without_a_checkpoint(capsys):
    report = _cli_json(capsys, "--num-layers", "32", "--num-kv-heads", "8", "--head-dim", "128", "--context", "8192")
    assert report["model"] is None and report["num_attention_heads"] is None
    assert report["kv_dtype"] == "float16"  # auto without a config
    assert report["kv_bytes_per_token"] == 131_072  # Llama-3-8B's shape
    assert report["kv_bytes_total"] == 131_072 * 8192
    assert _cli("--num-layers", "80", "--num-kv-heads", "8", "--head-dim", "128", "--num-heads", "64",
                "--context", "8192", "--memory", "80GB") == 0
    out = capsys.readouterr().out
    assert "(none: the shape from flags)" in out
    assert "80 layers, 64 heads, 8 KV heads (GQA), head_dim 128" in out
    assert "29 sequences of 8,192 tokens" in out  # as from Llama-3-70B's config.json


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-kv-heads", "8", "--head-dim", "128"],
         "without --model, pass the shape as flags: missing --num-layers"),
        (["--num-layers", "32", "--head-dim", "128"], "missing --num-kv-heads"),
        (["--num-layers", "32", "--num-kv-heads", "8"], "missing --head-dim"),
        ([], "missing --num-layers, --num-kv-heads, --head-dim"),
        (["--num-layers", "32", "--num-kv-heads", "0", "--head-dim", "128"],
         "--num-kv-heads must be a positive integer, got 0"),
    ],
)
def test_cli_shape_flags_errors_name_the_flag(capsys, argv, message):
    assert _cli(*argv) == 2
    assert message in capsys.readouterr().err


def test_cli_shape_flags_override_the_file(tmp_path, capsys):
    folder = _write_config(tmp_path / "8b", **LLAMA3_8B, max_position_embeddings=8192)
    report = _cli_json(capsys, "--model", folder, "--num-kv-heads", "1")
    assert (report["num_layers"], report["num_kv_heads"], report["head_dim"]) == (32, 1, 128)
    assert report["kv_bytes_per_token"] == 2 * 32 * 1 * 128 * 2
    report = _cli_json(capsys, "--model", folder, "--num-layers", "16", "--head-dim", "64", "--num-heads", "8")
    assert (report["num_layers"], report["num_kv_heads"], report["head_dim"]) == (16, 8, 64)
    assert report["num_attention_heads"] == 8 and report["context"] == 8192


def test_cli_gpt2_style_config(tmp_path, capsys):
    from transformers import GPT2Config

    GPT2Config().save_pretrained(tmp_path / "gpt2")  # n_layer 12, n_head 12, n_embd 768, n_positions 1024
    report = _cli_json(capsys, "--model", str(tmp_path / "gpt2"))
    assert (report["num_layers"], report["num_attention_heads"], report["num_kv_heads"], report["head_dim"]) == (
        12, 12, 12, 64)
    assert report["kv_bytes_per_token"] == 2 * 12 * 12 * 64 * 2
    assert report["context"] == 1024  # n_positions
    # GPT-BigCode (StarCoder): GPT-2's keys, multi-query attention.
    folder = _write_config(tmp_path / "bigcode", n_layer=40, n_head=48, n_embd=6144, n_positions=8192,
                           multi_query=True)
    report = _cli_json(capsys, "--model", folder)
    assert (report["num_kv_heads"], report["head_dim"]) == (1, 128)
    assert report["kv_bytes_per_token"] == 2 * 40 * 1 * 128 * 2


def test_cli_falcon_style_configs(tmp_path, capsys):
    from transformers import FalconConfig

    # Falcon-7B as first published (RW keys): n_layer, n_head, multi_query, no num_hidden_layers.
    folder = _write_config(tmp_path / "rw7b", n_layer=32, n_head=71, hidden_size=4544, multi_query=True)
    report = _cli_json(capsys, "--model", folder, "--context", "2048")
    assert (report["num_layers"], report["num_attention_heads"], report["num_kv_heads"], report["head_dim"]) == (
        32, 71, 1, 64)
    assert report["kv_bytes_per_token"] == 2 * 32 * 1 * 64 * 2
    # Falcon-7B saved by transformers: num_kv_heads (= n_head) is written too, but multi_query wins, as in
    # transformers' FalconAttention.
    FalconConfig(hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True).save_pretrained(
        tmp_path / "7b")
    report = _cli_json(capsys, "--model", str(tmp_path / "7b"))
    assert (report["num_kv_heads"], report["head_dim"], report["context"]) == (1, 64, 2048)
    # Falcon-40B: the new decoder architecture reads num_kv_heads (RW's n_head_kv in the first release).
    FalconConfig(hidden_size=8192, num_hidden_layers=60, num_attention_heads=128, num_kv_heads=8,
                 new_decoder_architecture=True).save_pretrained(tmp_path / "40b")
    report = _cli_json(capsys, "--model", str(tmp_path / "40b"))
    assert (report["num_layers"], report["num_kv_heads"], report["head_dim"]) == (60, 8, 64)
    assert report["kv_bytes_per_token"] == 2 * 60 * 8 * 64 * 2
    folder = _write_config(tmp_path / "rw40b", n_layer=60, n_head=128, hidden_size=8192, n_head_kv=8,
                           new_decoder_architecture=True)
    assert _cli_json(capsys, "--model", folder, "--context", "2048")["kv_bytes_per_token"] == 2 * 60 * 8 * 64 * 2


# --------------------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("80GB", 80 * 10**9),
        ("1e9", 10**9),
        ("4096", 4096),
        ("100B", 100),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("3TB", 3 * 10**12),
        ("1TiB", 1024**4),
        ("1.5 GiB", 3 * 1024**3 // 2),
        ("0.1KB", 100),  # exact: no float rounding up to 101 or down to 99
        ("2.5e3MB", 2500 * 10**6),
        ("  8gib ", 8 * 1024**3),  # units are case-insensitive; surrounding spaces are ignored
        ("0", 0),
        ("1.7B", 1),  # fractions of a byte round down
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "2 GiBs", "1K", "inf", "nan", "1,000", "0x10", "1e99999"])
def test_parse_size_errors(text):
    with pytest.raises(ValueError, match="invalid size " + re.escape(repr(text))):
        parse_size(text)


def test_parse_size_rejects_non_strings():
    with pytest.raises(TypeError, match="expects a string"):
        parse_size(1024)


def test_format_size():
    assert [format_size(n) for n in (0, 1023, 1536, 3 * 1024**3)] == ["0 B", "1023 B", "1.50 KiB", "3.00 GiB"]


def test_cli_tensor_parallel_figures_are_per_rank(capsys):
    shape = ("--num-layers", "80", "--num-kv-heads", "8", "--head-dim", "128", "--context", "8192",
             "--kv-dtype", "bfloat16", "--memory", "20GiB")
    whole = _cli_json(capsys, *shape)
    r = _cli_json(capsys, *shape, "--tensor-parallel-size", "4")
    assert r["kv_heads_per_rank"] == 2 and r["kv_bytes_per_token"] * 4 == whole["kv_bytes_per_token"]
    assert r["max_sequences_in_memory"] == 4 * whole["max_sequences_in_memory"]
    mqa = _cli_json(capsys, "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "64", "--tensor-parallel-size", "2")
    assert mqa["kv_heads_per_rank"] == 1 and mqa["kv_bytes_per_token_all_ranks"] == 2 * mqa["kv_bytes_per_token"]
    assert _cli(*shape, "--tensor-parallel-size", "3") == 2
    assert "neither split nor replicate 8 KV heads" in capsys.readouterr().err
