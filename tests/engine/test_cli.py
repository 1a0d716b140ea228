"""`kvserve generate` and the CLI's error path, in-process."""
from __future__ import annotations

import json

from kvserve.cli.main import main


def test_generate_jsonl_in_and_out(tiny_llama, tmp_path):
    path, _ = tiny_llama
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "Hello", "max_tokens": 3}\n'
                   '{"id": "b", "prompt_token_ids": [5, 6, 7], "max_tokens": 5, "seed": 3, "temperature": 1.0}\n')
    dst = tmp_path / "out.jsonl"
    rc = main(["generate", "--input", str(src), "--output", str(dst), "--model", path, "--ignore-eos",
               "--no-progress", "--num-gpu-blocks-override", "32", "--max-tokens", "9"])
    assert rc == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"]
    assert [len(r["outputs"][0]["token_ids"]) for r in rows] == [3, 5]
    assert rows[1]["num_prompt_tokens"] == 3


def test_generate_prints_and_reports_bad_input(tiny_llama, tmp_path, capsys):
    path, _ = tiny_llama
    assert main(["generate", "hi there", "--model", path, "--max-tokens", "2", "--ignore-eos", "--no-progress",
                 "--num-gpu-blocks-override", "16"]) == 0
    assert "[2 tokens, finish_reason=length]" in capsys.readouterr().out
    assert main(["generate", "--model", path]) == 2
    assert "no prompts" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["generate", "--input", str(bad), "--model", path]) == 2
    assert "bad.jsonl:1: not valid JSON" in capsys.readouterr().err
    assert main(["generate", "x", "--model", path, "--temperature", "-1"]) == 2
    assert "temperature must be non-negative" in capsys.readouterr().err
    assert main(["generate", "x", "--model", str(tmp_path / "nope")]) == 2
    assert "model not found" in capsys.readouterr().err
