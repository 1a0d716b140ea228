"""Stepping an Engine in tests with its block invariants checked after every step."""
from __future__ import annotations

# Golden and equivalence tests run on each CPU attention backend: the C++ kernel one and the reference.
# The engine tier runs the first only unless pytest is given --all-backends (tests/conftest.py).
ATTENTION_BACKENDS = ("cpu_paged", "torch_ref")


def check_engine_invariants(engine) -> None:
    """Block accounting after a step: see Scheduler.check_invariants."""
    engine.scheduler.check_invariants()


def step_until_idle(engine, check_every_step: bool = True, after_step=None) -> dict:
    """Step the engine until idle, asserting block invariants after every step (and `after_step(engine)`,
    if given); returns the final outputs by request id. No block may stay in use at the end."""
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if check_every_step:
            check_engine_invariants(engine)
        if after_step is not None:
            after_step(engine)
        steps += 1
        assert steps < 100_000
    counts = engine.block_pool.counts()
    assert counts["in_use"] == 0, f"blocks still in use after all requests finished: {counts}"
    return finished


def run_to_completion(engine, check_every_step: bool = True, after_step=None) -> dict:
    """step_until_idle, then the prefix cache emptied: every block must be free again."""
    finished = step_until_idle(engine, check_every_step, after_step)
    engine.scheduler.kv.reset_prefix_cache()
    assert engine.block_pool.counts()["free"] == engine.block_pool.num_blocks
    return finished


def run_last_after_prefix(engine, prompts: list, params) -> dict:
    """All prompts but the last to completion, then the last (whose prefix the others left in the prefix
    cache, so it is a cache hit), then the cache emptied; invariants after every step. Outputs by index."""
    for i, prompt in enumerate(prompts[:-1]):
        engine.add_request(str(i), prompt, params)
    done = step_until_idle(engine)
    engine.add_request(str(len(prompts) - 1), prompts[-1], params)
    done |= run_to_completion(engine)
    return done


def run_requests(engine, reqs: list[tuple[list[int], int]], params_for, after_step=None) -> dict:
    """(prompt, max_tokens) requests, request i with `params_for(i, max_tokens)`, stepped until idle with the
    invariants (and `after_step(engine)`) after every step; the final outputs by request id ("0", "1", ...)."""
    for i, (prompt, max_tokens) in enumerate(reqs):
        engine.add_request(str(i), prompt, params_for(i, max_tokens))
    return step_until_idle(engine, after_step=after_step)


def check_tables_cover_only_computed(engine) -> None:
    """After a step, no request holds a block past its verified tokens (rejected drafts gave theirs back)."""
    sched = engine.scheduler
    bs = sched.kv.block_size
    for req in sched.running:
        assert sched.kv.num_blocks_held(req.request_id) == -(-req.num_computed_tokens // bs), req.request_id
