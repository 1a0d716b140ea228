"""The ```python and ```bash blocks of the README and of every docs/features/*.md page run as pasted. The
convention (also the README's first lines), the same for every page:

- every ```python / ```bash block runs (```py, ```sh and ```shell too), each in a fresh process from the
  repository root: Python blocks with this interpreter, bash blocks with `bash -e -o pipefail`, where
  `kvserve` and `python` mean this checkout;
- an HTML comment `<!-- not run: REASON -->` on the line before a block's opening fence (blank lines
  between are allowed) skips it; the reason is required and shows as the skip reason;
- placeholder paths (`path/to/...`, `/path/to/...`) are replaced by what the test makes, per PLACEHOLDERS
  (a tiny random Llama checkpoint, a PEFT adapter for it); a placeholder not in that table fails the test,
  naming it: add it there or mark the block not run;
- a block that uses http://127.0.0.1:8000 (or localhost:8000), the quick start's `kvserve serve`, runs
  against a server with default flags (built-in model) that the test starts on a free port;
- other fences (```text, ```json, ``` alone) are not run.

A block passes when it exits 0 and no JSON line it prints (SSE `data:` lines included) is an error body.
New README sections and new docs/features pages need nothing here: their blocks run under the same rules.
Each test id names the file and the line of the block's fence, e.g. `docs/features/lora.md:python-line9`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.server import start_server, stop_server

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
FEATURE_PAGES = sorted((REPO / "docs" / "features").glob("*.md"))
PAGES = [README, *FEATURE_PAGES]
README_MAX_LINES = 200
LANGS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
# placeholder path -> the fixture that makes what it stands for
PLACEHOLDERS = {"path/to/hf-folder": "tiny_model_dir", "path/to/base": "tiny_model_dir",
                "/path/to/sql-lora": "tiny_lora_dir"}
QUICK_START_ADDRESSES = ("127.0.0.1:8000", "localhost:8000")
BLOCK_TIMEOUT_S = 600

_OPEN = re.compile(r"^(\s*)```(\w*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not run:(.*?)-->$")
_PLACEHOLDER = re.compile(r"(?<![\w.~-])/?path/to/[\w.\-/]*\w")


@dataclass(frozen=True)
class Block:
    lang: str  # the fence's word: python, bash, text, ""
    line: int  # 1-based line of the opening fence
    text: str
    not_run: str | None  # the reason of a `not run:` mark, "" for a mark without one, None when unmarked
    page: str = "README.md"  # the file it comes from, relative to the repository root


def readme_blocks(markdown: str) -> list[Block]:
    """Every fenced block, with the `not run:` mark before it, if any."""
    lines = markdown.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if m is None:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        before = i - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        mark = _NOT_RUN.match(lines[before].strip()) if before >= 0 else None
        body = textwrap.dedent("\n".join(lines[i + 1:end]))
        blocks.append(Block(m.group(2), i + 1, body, mark.group(1).strip() if mark else None))
        i = end + 1
    return blocks


def page_blocks(path: Path) -> list[Block]:
    """The runnable blocks of one page, each knowing its file."""
    page = path.relative_to(REPO).as_posix()
    return [dataclasses.replace(b, page=page) for b in readme_blocks(path.read_text(encoding="utf-8"))
            if b.lang in LANGS]


BLOCKS = [b for path in PAGES for b in page_blocks(path)]


# ---- what blocks refer to -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("readme") / "hf-folder")
    make_tiny_checkpoint(path, "llama")
    return path


@pytest.fixture(scope="module")
def tiny_lora_dir(tiny_model_dir, tmp_path_factory) -> str:
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    path = str(tmp_path_factory.mktemp("readme") / "sql-lora")
    peft.get_peft_model(base, cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def quick_start_server(tmp_path_factory):
    """`kvserve serve` as `make serve` starts it (no --model: the built-in one), but on a free port, one thread
    and a smaller KV pool."""
    srv = start_server(None, tmp_path_factory.mktemp("readme") / "server.log", "--kv-cache-memory", "256MiB",
                       timeout=300)
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory) -> dict[str, str]:
    """`kvserve` and `python` on PATH as this checkout with this interpreter (not whatever is installed)."""
    bin_dir = tmp_path_factory.mktemp("readme_bin")
    for name, target in (("kvserve", f'"{sys.executable}" -m kvserve.cli.main'), ("python", f'"{sys.executable}"'),
                         ("python3", f'"{sys.executable}"')):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        shim.chmod(0o755)
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": pythonpath,
            "PYTHONUNBUFFERED": "1"}


def _resolve(block: Block, request) -> str:
    """The block's text with placeholders and the quick-start address replaced."""
    text = block.text
    found = sorted(set(_PLACEHOLDER.findall(text)), key=len, reverse=True)
    unknown = [p for p in found if p not in PLACEHOLDERS]
    if unknown:
        pytest.fail(f"{block.page} line {block.line}: placeholder(s) {unknown} are not in tests/e2e/test_readme.py's "
                    f"PLACEHOLDERS; add them there, or mark the block <!-- not run: REASON -->")
    for placeholder in found:
        text = text.replace(placeholder, request.getfixturevalue(PLACEHOLDERS[placeholder]))
    if any(address in text for address in QUICK_START_ADDRESSES):
        host_port = request.getfixturevalue("quick_start_server").base_url.split("://", 1)[1]
        for address in QUICK_START_ADDRESSES:
            text = text.replace(address, host_port)
    return text


def _error_bodies(output: str) -> list[str]:
    """JSON lines of the output that are API error bodies (OpenAI's {"error": ...}, Anthropic's type error)."""
    errors = []
    for line in output.splitlines():
        line = line.strip().removeprefix("data:").strip()
        try:
            body = json.loads(line)
        except ValueError:
            continue
        if isinstance(body, dict) and ("error" in body or body.get("type") == "error"):
            errors.append(line)
    return errors


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.page}:{b.lang}-line{b.line}" for b in BLOCKS])
def test_readme_block_runs_as_pasted(block: Block, request, shell_env, tmp_path):
    if block.not_run is not None:
        if not block.not_run:
            pytest.fail(f"{block.page} line {block.line}: a `not run:` mark needs a reason")
        pytest.skip(f"{block.page}: not run: {block.not_run}")
    text = _resolve(block, request)
    if LANGS[block.lang] == "python":
        script = tmp_path / "block.py"
        script.write_text(text)
        cmd = [sys.executable, str(script)]
    else:
        script = tmp_path / "block.sh"
        script.write_text(text)
        cmd = ["bash", "-e", "-o", "pipefail", str(script)]
    proc = subprocess.run(cmd, cwd=REPO, env=shell_env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    report = f"{block.page} line {block.line} ({block.lang}):\n{text}\n--- stdout:\n{proc.stdout}\n--- stderr:\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert not _error_bodies(proc.stdout), report


def test_the_convention_is_stated_and_read():
    markdown = README.read_text(encoding="utf-8")
    assert "tests/e2e/test_readme.py" in markdown.split("\n# ", 1)[0]  # the HTML comment above the title
    sample = "\n".join([
        "<!-- not run: needs a GPU -->", "", "```bash", "nvidia-smi", "```",
        "```python", "print(1)", "```",
        "  ```sh", "  echo indented", "  ```",
        "<!-- not run: -->", "```bash", "true", "```",
        "```text", "diagram", "```"])
    blocks = readme_blocks(sample)
    assert [(b.lang, b.text, b.not_run) for b in blocks] == [
        ("bash", "nvidia-smi", "needs a GPU"), ("python", "print(1)", None), ("sh", "echo indented", None),
        ("bash", "true", ""), ("text", "diagram", None)]
    assert _PLACEHOLDER.findall('LLM("path/to/base") x /path/to/sql-lora, ../shared/x') == [
        "path/to/base", "/path/to/sql-lora"]
    assert _error_bodies('{"id": 1}\ndata: {"error": {"message": "bad"}}\ndata: [DONE]') == [
        '{"error": {"message": "bad"}}']


def test_readme_is_short_and_links_every_feature_page():
    markdown = README.read_text(encoding="utf-8")
    assert len(markdown.splitlines()) <= README_MAX_LINES
    assert FEATURE_PAGES, "docs/features/ has no pages"
    unlinked = [p.name for p in FEATURE_PAGES if f"docs/features/{p.name}" not in markdown]
    assert not unlinked, f"feature pages the README does not link: {unlinked}"
