"""The start-up check for pitfall 1 of the serving playbook: a KV pool that holds only a few requests at the
length they may grow to, so that past those few, admission stops (contiguous reservation) or running requests
are preempted and recomputed (paged). The figures are kv-calc's: pool tokens / tokens per request."""
from __future__ import annotations


def admission_warning(*, pool_tokens: int, max_model_len: int, max_num_seqs: int, default_max_tokens: int | None,
                      max_tokens_limit: int | None, kv_reservation: str = "paged",
                      max_tokens_held: int | None = None) -> str | None:
    """A warning when fewer than max_num_seqs requests fit the pool at their longest; None when they fit.

    A request's longest is max_model_len under contiguous reservation (it reserves that much), else its output
    bound: the tighter of the default max_tokens (for requests that leave it unset) and --max-tokens-limit, or
    max_model_len when neither bounds it. max_tokens_held: a windowed model's most tokens of blocks one request
    holds, however long (None: no such bound)."""
    bounds = [b for b in (default_max_tokens, max_tokens_limit) if b]
    longest = max_model_len if kv_reservation == "contiguous" or not bounds else min(max_model_len, min(bounds))
    fits = pool_tokens / min(longest, max_tokens_held or longest)
    if fits >= max_num_seqs:
        return None
    why = ("--kv-reservation contiguous sets aside max_model_len per request" if kv_reservation == "contiguous"
           else f"a request may generate up to {longest} tokens ("
                + ("max_tokens unset means up to max_model_len" if not bounds else
                   f"default max_tokens {default_max_tokens or 'none'}, --max-tokens-limit {max_tokens_limit or 'none'}")
                + ")")
    collapse = ("admission stops there" if kv_reservation == "contiguous"
                else "running requests are preempted and recomputed past that")
    return (f"the KV pool holds {pool_tokens} tokens: {fits:.2f} requests of {longest} tokens at once (kv-calc's "
            f"max concurrency at {longest} tokens), fewer than --max-num-seqs {max_num_seqs}; {why}, so "
            f"{collapse}. Set a default max_tokens (--override-generation-config '{{\"max_new_tokens\": N}}') or "
            f"--max-tokens-limit, lower --max-model-len, or raise the KV memory")
