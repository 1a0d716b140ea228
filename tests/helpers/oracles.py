"""Oracles the engine is compared with: transformers' logits and greedy tokens, one forward pass of our
paged model over a hand-built mixed batch, and dense attention over gathered K/V; assert_matches_hf and
assert_logits_match_hf put an engine side by side with transformers."""
from __future__ import annotations

import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.core_types import CachedRequestData, NewRequestData, SchedulerOutput
from tests.helpers.engine import run_to_completion


def paged_logits(engine: Engine, batch: list[tuple[list[int], int, int]]) -> list[torch.Tensor]:
    """Run one forward pass over requests given as (tokens, num_context, num_query): the first
    num_context tokens are computed in an earlier pass (through the cache); the returned logits are
    those of the num_query tokens after them, all requests in the same pass. Decodes go first."""
    kv = engine.scheduler.kv
    reqs = []
    for i, (tokens, ctx, q) in enumerate(batch):
        req = Request(f"r{i}", tokens[:ctx + q], SamplingParams(max_tokens=1))
        reqs.append((req, ctx, q))
    # pass 1: contexts
    pre = [(r, ctx) for r, ctx, _ in reqs if ctx > 0]
    for r, ctx in pre:
        assert kv.allocate_slots(r, ctx)
    if pre:
        _forward(engine, [(r, ctx) for r, ctx in pre])
        for r, ctx in pre:
            r.num_computed_tokens = ctx
    # pass 2: the mixed batch
    order = sorted(range(len(reqs)), key=lambda i: reqs[i][2] != 1)
    for r, _, q in reqs:
        assert kv.allocate_slots(r, q)
    logits = _forward(engine, [(reqs[i][0], reqs[i][2]) for i in order])
    out: list[torch.Tensor] = [None] * len(reqs)
    start = 0
    for i in order:
        q = reqs[i][2]
        out[i] = logits[start:start + q]
        start += q
    for r, _, _ in reqs:
        kv.free(r)
    engine.core.executor.worker.runner.update_states(SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(), num_scheduled_tokens={},
        total_num_scheduled_tokens=0, finished_req_ids={r.request_id for r, _, _ in reqs}))
    return out


@torch.inference_mode()
def _forward(engine: Engine, entries) -> torch.Tensor:
    """One forward pass over (request, tokens to compute) entries, through the worker's own input path;
    the logits of every computed token."""
    kv = engine.scheduler.kv
    runner = engine.core.executor.worker.runner
    new, cached = [], CachedRequestData()
    for r, _ in entries:
        block_ids = kv.block_ids(r.request_id)
        known = runner.requests.get(r.request_id)
        if known is None:
            new.append(NewRequestData(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                                      sampling_params=r.sampling_params, eos_token_ids=(), block_ids=block_ids,
                                      num_computed_tokens=r.num_computed_tokens))
        else:
            cached.req_ids.append(r.request_id)
            cached.resumed_from_preemption.append(False)
            cached.new_block_ids.append(block_ids[runner.batch.num_blocks[runner.batch.index[r.request_id]]:])
            cached.num_computed_tokens.append(r.num_computed_tokens)
    out = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                          num_scheduled_tokens={r.request_id: n for r, n in entries},
                          total_num_scheduled_tokens=sum(n for _, n in entries))
    runner.update_states(out)
    inputs = runner.prepare_inputs(out)
    hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches,
                          runner.backend.build_metadata(inputs.attn))
    return runner.model.compute_logits(hidden)


@torch.inference_mode()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0].float()


def mixed_batch(seed: int, vocab: int = 49152):
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    return [
        (toks(37), 0, 37),    # fresh prefill
        (toks(60), 40, 20),   # prefill chunk after cached context (crosses block boundaries)
        (toks(21), 20, 1),    # decode
        (toks(90), 89, 1),    # decode, long context
        (toks(1), 0, 1),      # one-token prompt
        (toks(33), 16, 17),   # chunk starting exactly at a block boundary
    ]



@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new: int, top: int = 0):
    """transformers' greedy tokens for `prompt` (on the model's device), and its top-`top` ids per step."""
    device = next(model.parameters()).device
    out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=max_new, min_new_tokens=max_new,
                         do_sample=False, output_scores=bool(top), return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, ([s[0].topk(top).indices.tolist() for s in out.scores] if top else None)


def dense_decode(q, ks, vs, scale):
    out = []
    for qi, k, v in zip(q, ks, vs):          # qi [Hq, D], k/v [L, Hkv, D]
        group = qi.shape[0] // k.shape[1]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)   # [Hq, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        w = torch.softmax((qi[:, None, :] @ k.transpose(1, 2)).squeeze(1) * scale, dim=-1)
        out.append((w[:, None, :] @ v).squeeze(1))
    return torch.stack(out)


def assert_matches_hf(engine_kwargs: dict | None, reqs: list[tuple[list[int], int]], hf, *,
                      engine: Engine | None = None, check_every_step: bool = True,
                      after_step=None) -> tuple[Engine, dict]:
    """Greedy (prompt, max_tokens) requests, ignore_eos, all queued at once through an Engine built from
    `engine_kwargs` (or the given `engine`): block invariants after every step (and `after_step(engine)`), every
    block free once the prefix cache is emptied; each request's tokens equal transformers' greedy tokens from
    `hf` and it ends by length. Returns the engine (for its stats) and the outputs by request index."""
    if engine is None:
        engine = Engine(EngineArgs(**engine_kwargs))
    for i, (prompt, max_tokens) in enumerate(reqs):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    finished = run_to_completion(engine, check_every_step, after_step)
    for i, (prompt, max_tokens) in enumerate(reqs):
        got = finished[str(i)].outputs[0]
        want, _ = hf_greedy(hf, prompt, max_tokens)
        assert got.token_ids == want, f"request {i} ({len(prompt)} prompt tokens) differs"
        assert got.finish_reason == "length"
    return engine, finished


def assert_logits_match_hf(engine: Engine, hf, batch: list[tuple[list[int], int, int]], atol: float,
                           rtol: float) -> None:
    """paged_logits over the (tokens, num_context, num_query) batch equal transformers' logits of the same
    positions within the tolerances; the block invariants hold after it."""
    for (tokens, ctx, q), got in zip(batch, paged_logits(engine, batch)):
        ref = hf_logits(hf, tokens[:ctx + q])[ctx:ctx + q]
        torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    engine.scheduler.check_invariants()
