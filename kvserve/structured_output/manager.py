"""StructuredOutputManager: the engine core's side of structured outputs.

- Compiling: a request's grammar compiles on a background thread, once per spec (futures cached by the
  spec's key), so an engine step never waits for a compile: the request waits in the queue while the others
  run (the scheduler admits it once `is_ready`).
- Matching: one xgrammar GrammarMatcher per request, advanced by `accept` over the tokens the request
  actually got. Drafts (speculative decoding) are only tried: `fill_bitmask` accepts a request's drafts to
  fill the rows of their positions and rolls them back, `valid_draft_prefix` cuts drafts at the first token
  the grammar refuses. So a rejected draft never reaches a matcher, and a preempted request's matcher stays
  right: recompute keeps the tokens it was advanced over.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.grammar import compile_grammar

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class StructuredOutputRequest:
    """One request's grammar: its compile (a future), then its matcher."""

    params: StructuredOutputsParams
    compiled: Future
    matcher: object | None = None
    """xgrammar GrammarMatcher once the grammar compiled and the request was admitted."""
    error: str | None = None
    """Why the grammar could not be compiled (the request then fails)."""


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, eos_token_ids: tuple[int, ...] = ()):
        """load_tokenizer: the model's tokenizer, loaded on first use (on the compile thread), for xgrammar's
        view of the vocabulary; vocab_size: the logits' width (may exceed the tokenizer's)."""
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._compiled: dict[tuple, Future] = {}
        """Spec key -> its compile (cached for the engine's lifetime: a service sees few distinct schemas)."""

    @property
    def bitmask_width(self) -> int:
        return -(-self.vocab_size // 32)

    # ---- compiling --------------------------------------------------------------------------
    def add(self, params: StructuredOutputsParams, eos_token_ids: tuple[int, ...] = ()) -> StructuredOutputRequest:
        """Start (or reuse) the compile of a request's grammar; returns at once."""
        if eos_token_ids and not self._eos_token_ids:
            self._eos_token_ids = list(eos_token_ids)
        key = params.key()
        future = self._compiled.get(key)
        if future is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
            future = self._executor.submit(self._compile, params)
            self._compiled[key] = future
        return StructuredOutputRequest(params, future)

    def _compile(self, params: StructuredOutputsParams):
        return compile_grammar(self.compiler(), params)

    def compiler(self):
        """xgrammar's GrammarCompiler for the model's vocabulary (built once, on first use)."""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size,
                                                          stop_token_ids=self._eos_token_ids or None)
                # NOTE: one compile thread: the engine step needs the other core.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def is_ready(self, so: StructuredOutputRequest, eos_token_ids: tuple[int, ...]) -> bool:
        """Whether the request can be scheduled: its grammar compiled (its matcher is made now) or failed
        (so.error is set; the scheduler fails the request)."""
        if so.matcher is not None or so.error is not None:
            return True
        if not so.compiled.done():
            return False
        try:
            compiled = so.compiled.result()
        except Exception as e:
            so.error = str(e)
            return True
        import xgrammar as xgr

        so.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(eos_token_ids) or None)
        return True

    def wait_for_compiles(self, timeout: float) -> None:
        """Block up to `timeout` seconds for any pending compile (an engine with nothing else to run)."""
        pending = [f for f in self._compiled.values() if not f.done()]
        if pending:
            from concurrent.futures import FIRST_COMPLETED, wait

            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    # ---- matching ---------------------------------------------------------------------------
    def fill_bitmask(self, entries: list[tuple[str, StructuredOutputRequest, list[int]]]
                     ) -> tuple[torch.Tensor, dict[str, int]]:
        """The step's token bitmask: per (request id, its grammar, drafts it verifies) 1 + len(drafts) rows,
        row j allowing the tokens the grammar takes after the drafts before j.

        Returns (bitmask [rows, ceil(vocab / 32)] int32, request id -> its first row). Matchers end where
        they started."""
        num_rows = sum(1 + len(drafts) for _, _, drafts in entries)
        bitmask = torch.full((num_rows, self.bitmask_width), -1, dtype=torch.int32)  # [rows, W]
        first_row: dict[str, int] = {}
        row = 0
        for req_id, so, drafts in entries:
            first_row[req_id] = row
            matcher = so.matcher
            matcher.fill_next_token_bitmask(bitmask, row)
            accepted = 0
            for token in drafts:
                row += 1
                # NOTE: drafts were cut at the grammar's first refusal (valid_draft_prefix), so this accepts.
                if matcher.is_terminated() or not matcher.accept_token(token):
                    break
                accepted += 1
                matcher.fill_next_token_bitmask(bitmask, row)
            row = first_row[req_id] + 1 + len(drafts)
            if accepted:
                matcher.rollback(accepted)
        return bitmask, first_row

    @staticmethod
    def accept(so: StructuredOutputRequest, token_ids: list[int]) -> bool:
        """Advance the request's matcher over its new tokens. Returns False if the grammar refuses one
        (a token the bitmask should have excluded: the request then fails)."""
        matcher = so.matcher
        for token in token_ids:
            if matcher.is_terminated() or not matcher.accept_token(token):
                return False
        return True

    @staticmethod
    def is_terminated(so: StructuredOutputRequest) -> bool:
        """The grammar is complete: it accepted its stop token, nothing more may follow."""
        return so.matcher.is_terminated()

    @staticmethod
    def valid_draft_prefix(so: StructuredOutputRequest, drafts: list[int]) -> int:
        """How many leading drafts the grammar accepts (the matcher ends where it started)."""
        matcher = so.matcher
        n = 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
