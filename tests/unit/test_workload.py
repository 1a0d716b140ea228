"""The built-in workloads ship in the package: `--workload mixed` names one, anything else is a path."""
from __future__ import annotations

import os

import pytest

from kvserve.bench.workload import BUILTIN_WORKLOADS, WORKLOAD_DIR, load_workload, workload_path


def test_every_builtin_name_loads_its_packaged_file():
    sizes = {name: len(load_workload(name)) for name in BUILTIN_WORKLOADS}
    assert sizes == {"mixed": 64, "prefix": 32, "interference": 18, "repeat": 16, "groups": 64}
    assert workload_path("mixed") == os.path.join(WORKLOAD_DIR, "mixed.jsonl")


def test_a_path_stays_a_path(tmp_path, monkeypatch):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2], "max_tokens": 3}\n')
    assert workload_path(str(path)) == str(path) and len(load_workload(str(path))) == 1
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mixed").write_text('{"prompt_token_ids": [4], "max_tokens": 1}\n')
    assert workload_path("mixed") == "mixed" and load_workload("mixed")[0].prompt_token_ids == [4]
    with pytest.raises(FileNotFoundError):
        load_workload("nope")
