"""Cascade attention in a real engine: requests behind one cached prefix decode together and match
transformers."""
from __future__ import annotations

import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.sampling_params import SamplingParams
from tests.helpers.engine import run_to_completion, step_until_idle
from tests.helpers.oracles import hf_logits


def test_engine_with_prefix_hits_decoding_together_matches_transformers(tiny_llama, monkeypatch):
    """Requests behind one cached 48-token prefix decode in the same steps (cascade groups used) beside an
    unrelated one; every greedy token is transformers' argmax on the same tokens (within a near-tie), and
    block invariants hold after every step."""
    path, hf = tiny_llama
    engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=64, attention_backend="cpu_paged",
                               max_num_batched_tokens=64, speculative_config=None))
    backend = engine.core.executor.worker.backend
    grouped = []
    build = backend.build_metadata

    def spy(common):
        meta = build(common)
        grouped.append(meta.shared is not None)
        return meta

    monkeypatch.setattr(backend, "build_metadata", spy)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 49152, (48,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request("first", prefix + [5, 6], params)
    step_until_idle(engine)                   # its blocks stay in the prefix cache
    prompts = {"first": prefix + [5, 6]}
    for i in range(4):
        prompts[f"p{i}"] = prefix + torch.randint(0, 49152, (3 + 7 * i,), generator=g).tolist()
    prompts["other"] = torch.randint(0, 49152, (40,), generator=g).tolist()
    for rid, p in prompts.items():
        if rid != "first":
            engine.add_request(rid, p, params)
    grouped.clear()
    done = run_to_completion(engine)
    assert engine.scheduler.stats.num_prefix_hit_tokens >= 4 * 48
    assert any(grouped)
    for rid, p in prompts.items():
        if rid == "first":
            continue
        tokens = done[rid].outputs[0].token_ids
        ref = hf_logits(hf, p + tokens)[len(p) - 1:-1]                     # the logits each token came from
        chosen = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (chosen >= ref.max(dim=1).values - 1e-3).all(), rid
