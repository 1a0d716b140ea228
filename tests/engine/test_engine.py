"""Engine and LLM behaviour end to end on a tiny checkpoint: validation, stops, n > 1, seeds, aborts."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from tests.helpers.engine import ATTENTION_BACKENDS, check_engine_invariants, run_to_completion


@pytest.fixture
def engine(tiny_llama):
    path, _ = tiny_llama
    return Engine(EngineArgs(model=path, num_gpu_blocks_override=96, max_model_len=512,
                             max_num_batched_tokens=64))


def _greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(max_tokens=-3), "max_tokens must be an integer >= 1, got -3"),
    (dict(temperature=-0.5), "temperature must be non-negative, got -0.5"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=-2), "top_k must be -1 .* got -2"),
    (dict(n=0), "n must be an integer >= 1, got 0"),
    (dict(min_p=2.0), r"min_p must be in \[0, 1\], got 2.0"),
    (dict(stop=[""]), "stop must be non-empty strings"),
    (dict(logit_bias={5: 500.0}), r"logit_bias values must be in \[-100, 100\]"),
])
def test_bad_sampling_params_raise_precise_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_requests_are_refused_and_the_rest_keep_running(engine):
    engine.add_request("good1", [5, 6, 7], _greedy())
    engine.step()
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request("bad1", [], _greedy())
    with pytest.raises(ValueError, match=r"prompt has 600 tokens, but max_model_len is 512"):
        engine.add_request("bad2", [5] * 600, _greedy())
    with pytest.raises(ValueError, match=r"prompt \(500 tokens\) \+ max_tokens \(20\) = 520 tokens exceeds "
                                         r"max_model_len \(512\)"):
        engine.add_request("bad3", [5] * 500, _greedy(max_tokens=20))
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 49152\)"):
        engine.add_request("bad4", [5, 10**6], _greedy())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good1", [1], _greedy())
    engine.add_request("good2", "hello there", _greedy())
    done = run_to_completion(engine)
    assert set(done) == {"good1", "good2"}
    assert all(len(o.outputs[0].token_ids) == 12 for o in done.values())


def test_request_larger_than_the_pool_is_refused(tiny_llama):
    path, _ = tiny_llama
    engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=4, max_model_len=512))
    with pytest.raises(ValueError, match=r"needs 5 KV blocks, but the whole pool has 4"):
        engine.add_request("big", [5] * 70, _greedy(max_tokens=10))


def test_stop_string_split_across_tokens(engine):
    engine.add_request("probe", "The cat", _greedy(max_tokens=16, skip_special_tokens=False))
    probe = run_to_completion(engine)["probe"].outputs[0]
    tok = engine.tokenizer
    pieces = [tok.decode(probe.token_ids[:i]) for i in range(len(probe.token_ids) + 1)]
    # a stop string straddling the boundary after token k, found by incremental detokenization
    k = next(i for i in range(3, len(pieces) - 1)
             if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) - len(pieces[i]) >= 2)
    stop = pieces[k + 1][len(pieces[k]) - 2:len(pieces[k]) + 2]
    want_cut = probe.text.find(stop)
    assert want_cut != -1
    for include in (False, True):
        engine.add_request(f"s{include}", "The cat", _greedy(max_tokens=16, stop=[stop],
                                                             include_stop_str_in_output=include,
                                                             skip_special_tokens=False))
        out = run_to_completion(engine)[f"s{include}"].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == probe.text[:want_cut + (len(stop) if include else 0)]
        assert len(out.token_ids) < len(probe.token_ids)


def test_streamed_text_deltas_add_up_to_the_final_text(engine):
    engine.add_request("r", "Once upon a time", SamplingParams(temperature=0.8, seed=7, max_tokens=30,
                                                               ignore_eos=True, stop=["xyzzy"]))
    streamed = ""
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.new_texts[0]
            final = out
        check_engine_invariants(engine)
    assert final.finished and streamed == final.outputs[0].text


def test_min_tokens_logit_bias_eos_and_stop_token_ids(engine):
    eos = engine.eos_token_ids[0]
    engine.add_request("eos", [5, 6], SamplingParams(temperature=0, max_tokens=20, min_tokens=5,
                                                     logit_bias={eos: 100.0}))
    engine.add_request("stopid", [5, 6], SamplingParams(temperature=0, max_tokens=20, logit_bias={42: 100.0},
                                                        stop_token_ids=[42]))
    done = run_to_completion(engine)
    out = done["eos"].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    out = done["stopid"].outputs[0]
    assert out.token_ids == [42] and out.finish_reason == "stop" and out.stop_reason == 42


def test_logprobs_top_k_and_ranks(engine):
    engine.add_request("lp", [5, 6, 7], _greedy(max_tokens=4, logprobs=3))
    out = run_to_completion(engine)["lp"].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token].rank == 1  # greedy picks the top token
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        values = [lp.logprob for lp in sorted(entry.values(), key=lambda lp: lp.rank)]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_seeded_request_is_reproducible_whatever_its_batch_mates(engine):
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    engine.add_request("alone", [11, 12, 13], target)
    alone = run_to_completion(engine)["alone"].outputs[0].token_ids
    for trial in range(2):
        for j in range(3 + trial * 2):
            mate = SamplingParams(temperature=1.3, max_tokens=5 + j, ignore_eos=True,
                                  seed=None if j % 2 else 99 + j)
            engine.add_request(f"mate{trial}-{j}", [20 + j] * (j * 7 + 1), mate)
            if j == 1:
                engine.add_request(f"t{trial}", [11, 12, 13], target)
        assert run_to_completion(engine)[f"t{trial}"].outputs[0].token_ids == alone
    engine.add_request("other", [11, 12, 13], target.clone(seed=4321))
    assert run_to_completion(engine)["other"].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt_blocks(engine):
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks of 16
    engine.add_request("n", prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))
    shared_max = 0
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        check_engine_invariants(engine)
        shared_max = max(shared_max, max(b.ref_count for b in engine.block_pool.blocks))
    assert shared_max == 4, "all four samples hold the prompt's full blocks"
    assert engine.scheduler.stats.num_prefix_hit_tokens >= 3 * 48
    assert [o.index for o in final.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in final.outputs)
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1


def test_abort_frees_blocks_in_the_same_step(engine):
    engine.add_request("a", [5] * 40, _greedy(max_tokens=50))
    engine.add_request("b", [6] * 40, _greedy(max_tokens=5))
    for _ in range(3):
        engine.step()
    held = engine.scheduler.kv.num_blocks_held("a")
    before = engine.block_pool.counts()["in_use"]
    engine.abort_request("a")
    assert engine.block_pool.counts()["in_use"] == before - held
    check_engine_invariants(engine)
    done = run_to_completion(engine)
    assert done["a"].outputs[0].finish_reason == "abort"
    assert done["b"].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_prefix_caching_on_and_off_give_identical_greedy_outputs(tiny_llama, backend):
    path, _ = tiny_llama
    shared = list(range(300, 340))
    prompts = [shared + [i, i + 1] for i in range(6)] + [shared[:17], [9] + shared]
    results = []
    for on in (True, False):
        engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=24, enable_prefix_caching=on,
                                   max_num_batched_tokens=48, attention_backend=backend))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, _greedy(max_tokens=10))
        done = run_to_completion(engine)
        results.append([done[str(i)].outputs[0].token_ids for i in range(len(prompts))])
        if on:
            assert engine.scheduler.stats.num_prefix_hit_tokens > 0
    assert results[0] == results[1]


def test_llm_generate_keeps_input_order_and_chat(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, num_gpu_blocks_override=64, max_num_batched_tokens=32)
    prompts = ["a b c d e f g h i j k l m n o p", "hi", [7, 8, 9]]
    outs = llm.generate(prompts, [_greedy(max_tokens=m) for m in (3, 9, 5)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 5]
    assert outs[0].prompt == prompts[0] and outs[2].prompt_token_ids == [7, 8, 9]
    assert outs[1].metrics.time_to_first_token is not None
    with pytest.raises(ValueError, match="prompt 1: prompt must not be empty"):
        llm.generate(["fine", ""], _greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    chat = llm.chat([{"role": "user", "content": "Hello!"}], _greedy(max_tokens=4), use_tqdm=False)
    assert chat[0].prompt.startswith("<|im_start|>") and chat[0].prompt.endswith("<|im_start|>assistant\n")
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(path, max_num_sequences=3)
