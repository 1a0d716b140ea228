"""The start-up warning for a KV pool that holds few requests at their longest (the playbook's pitfall 1)."""
from __future__ import annotations

from kvserve.kv_cache.admission_check import admission_warning


def test_unbounded_max_tokens_on_a_small_pool_warns_with_kv_calc_numbers():
    w = admission_warning(pool_tokens=46_000, max_model_len=8192, max_num_seqs=256, default_max_tokens=None,
                          max_tokens_limit=None)
    assert w.startswith("the KV pool holds 46000 tokens: 5.62 requests of 8192 tokens at once")
    assert "fewer than --max-num-seqs 256" in w and "max_tokens unset means up to max_model_len" in w
    assert "preempted" in w and "max_new_tokens" in w


def test_a_default_max_tokens_that_fits_is_quiet_but_contiguous_reservation_is_not():
    kw = dict(pool_tokens=46_000, max_model_len=8192, max_num_seqs=256, max_tokens_limit=None)
    assert admission_warning(default_max_tokens=50, **kw) is None
    w = admission_warning(default_max_tokens=50, kv_reservation="contiguous", **kw)
    assert "sets aside max_model_len per request" in w and "admission stops there" in w


def test_the_tighter_bound_counts_and_a_window_caps_what_a_request_holds():
    kw = dict(pool_tokens=10_000, max_model_len=4096, max_num_seqs=64)
    w = admission_warning(default_max_tokens=2048, max_tokens_limit=1024, **kw)
    assert "9.77 requests of 1024 tokens" in w and "default max_tokens 2048, --max-tokens-limit 1024" in w
    assert admission_warning(default_max_tokens=None, max_tokens_limit=None, max_tokens_held=128, **kw) is None
