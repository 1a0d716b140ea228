"""Recording each request's logits by position through an Engine, for the batch-invariance tests: which rows a
step sampled (worker/step_inputs.StepInputs) and the LM head's output for them, kept per (request, position).

A row of a request verifying drafts describes the real sequence only while the drafts before it were all
accepted: `LogitsRecorder.by_position` keeps exactly the rows whose inputs match the request's final tokens."""
from __future__ import annotations

import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.sampling_params import SamplingParams
from tests.helpers.engine import run_to_completion, step_until_idle


class LogitsRecorder:
    """Wraps one engine's model runner: every sampled logits row with its request, position and input token."""

    def __init__(self, engine: Engine):
        runner = engine.core.executor.worker.runner  # the in-process worker (tensor_parallel_size 1)
        self.rows: list[tuple[str, int, list[int], torch.Tensor]] = []
        """(req_id, position of the row, input tokens of the step's rows up to this one, logits [vocab])"""
        prepare, logits_of = runner.prepare_inputs, runner.model.compute_logits
        current = {}

        def prepare_inputs(out):
            current["inputs"] = inputs = prepare(out)
            return inputs

        def compute_logits(hidden):
            logits = logits_of(hidden)
            inputs = current.pop("inputs", None)
            if inputs is not None and len(inputs.logits_indices) == logits.shape[0]:
                self._record(inputs, logits)
            return logits

        runner.prepare_inputs = prepare_inputs
        runner.model.compute_logits = compute_logits

    def _record(self, inputs, logits: torch.Tensor) -> None:
        idx = inputs.logits_indices.tolist()
        positions, ids = inputs.positions[inputs.logits_indices].tolist(), inputs.input_ids[inputs.logits_indices]
        lo = 0
        for req_id, n in zip(inputs.sample_req_ids, inputs.num_logits.tolist()):
            for j in range(n):
                self.rows.append((req_id, positions[lo + j], ids[lo:lo + j + 1].tolist(), logits[lo + j].clone()))
            lo += n
        assert lo == len(idx)

    def by_position(self, req_id: str, tokens: list[int]) -> dict[int, torch.Tensor]:
        """Position -> logits of `req_id`'s real rows (`tokens`: its prompt and output). A position computed
        twice (a preemption's recompute) must give the same bits both times."""
        out: dict[int, torch.Tensor] = {}
        for rid, pos, inputs, logits in self.rows:
            first = pos - len(inputs) + 1
            if rid != req_id or inputs[1:] != tokens[first + 1:pos + 1]:
                continue  # a row after a rejected draft
            if pos in out:
                assert torch.equal(out[pos], logits), f"{req_id}: position {pos} recomputed with other bits"
            out[pos] = logits
        return out


def make_wide_checkpoint(path: str, seed: int = 0):
    """A tiny Qwen2 (q/k/v biases, tied embeddings) wide enough that the default kernels are NOT row-invariant:
    oneDNN's matmul changes its K blocking with the number of rows at an input of 1536 (the MLP's down
    projection), so a test that passes here would fail without the mode. Returns transformers' model."""
    import transformers as tf

    from tests.helpers.checkpoints import write_random_checkpoint

    cfg = tf.Qwen2Config(vocab_size=49152, hidden_size=128, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    return write_random_checkpoint(path, cfg, seed)


class KnownProposer:
    """Drafts that are the known continuation of some requests (`known`: req_id -> its whole token sequence),
    so that every draft is accepted and each verification row scores a real position; other requests get
    `inner`'s drafts (ngram)."""

    name = "known"

    def __init__(self, inner, known: dict[str, list[int]]):
        self.inner, self.known = inner, known

    def propose(self, batch, rows, num_drafts) -> list[list[int]]:
        drafts = self.inner.propose(batch, rows, num_drafts)
        for i, (row, k) in enumerate(zip(rows, num_drafts)):
            tokens = self.known.get(batch.req_ids[row])
            if tokens is not None:
                n = int(batch.num_tokens[row])
                drafts[i] = tokens[n:n + int(k)]
        return drafts


def run_recorded(engine_kwargs: dict, requests: list[tuple[str, list[int], SamplingParams]], *,
                 first: list[tuple[str, list[int], SamplingParams]] = (),
                 known_drafts: dict[str, list[int]] | None = None) -> tuple[Engine, LogitsRecorder, dict]:
    """An engine with `engine_kwargs` (batch-invariant), `first` run to idle, then `requests` together, with the
    block invariants after every step and every block free at the end; (engine, recorder, outputs by id).
    known_drafts: speculation proposes these requests' known continuations (KnownProposer)."""
    engine = Engine(EngineArgs(**engine_kwargs))
    recorder = LogitsRecorder(engine)
    if known_drafts:
        runner = engine.core.executor.worker.runner
        runner.proposer = KnownProposer(runner.proposer, known_drafts)
    done = {}
    for req_id, prompt, params in first:
        engine.add_request(req_id, prompt, params)
    if first:
        done |= step_until_idle(engine)
    for req_id, prompt, params in requests:
        engine.add_request(req_id, prompt, params)
    done |= run_to_completion(engine)
    return engine, recorder, done


def request_logits(recorder: LogitsRecorder, done: dict, req_id: str, prompt: list[int]) -> dict[int, torch.Tensor]:
    """`req_id`'s logits by position, from its last prompt position on."""
    tokens = prompt + list(done[req_id].outputs[0].token_ids)
    return recorder.by_position(req_id, tokens)


def assert_same_logits(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor], num_outputs: int) -> None:
    """Bit-identical logits at every position both runs computed, and those cover every output token."""
    common = sorted(set(a) & set(b))
    assert len(common) >= num_outputs, f"only {len(common)} common positions for {num_outputs} output tokens"
    for pos in common:
        if not torch.equal(a[pos], b[pos]):
            diff = (a[pos] - b[pos]).abs().max().item()
            raise AssertionError(f"logits at position {pos} differ (max |diff| {diff:.3g})")
