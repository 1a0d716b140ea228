"""Multi-LoRA: one batch mixing the base model and three PEFT adapters gives each request transformers+peft's
greedy tokens (and logprobs); more adapters than slots swap without changing a token; adapters never share
prefix-cache KV (one adapter's requests do); bad adapters are refused at admission with a ValueError that
names the problem; block invariants hold after every step."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from kvserve import LLM, LoRARequest
from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.sampling_params import SamplingParams
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.engine import step_until_idle
from tests.helpers.lora import ADAPTERS, make_adapter

peft = pytest.importorskip("peft")
MAX_NEW = 8

@torch.inference_mode()
def _hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """(base path, {name: LoRARequest}, prompts, {(name or None, prompt idx): oracle tokens}, {name: peft model})."""
    root = tmp_path_factory.mktemp("lora")
    base_path = str(root / "base")
    base = make_tiny_checkpoint(base_path, "llama")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(5, 30))] for _ in range(3)]
    requests, models = {}, {}
    for i, (name, (targets, rslora)) in enumerate(ADAPTERS.items()):
        path = str(root / name)
        models[name] = make_adapter(base, path, targets, rslora, seed=10 + i)
        requests[name] = LoRARequest(name, i + 1, path)
    oracle = {(None, j): _hf_greedy(base, p) for j, p in enumerate(prompts)}
    for name, model in models.items():
        for j, p in enumerate(prompts):
            oracle[(name, j)] = _hf_greedy(model, p)
    for j in range(len(prompts)):  # the adapters really change the model
        assert len({tuple(oracle[(n, j)]) for n in [None, *ADAPTERS]}) > 1
    return base_path, requests, prompts, oracle, models


def _engine(path: str, **kwargs) -> Engine:
    args = {"model": path, "enable_lora": True, "num_gpu_blocks_override": 128, "block_size": 8,
            "max_num_batched_tokens": 48, "max_num_seqs": 32}
    args.update(kwargs)
    return Engine(EngineArgs(**args))


def _run(engine: Engine) -> dict:
    return step_until_idle(engine)


def _add_all(engine: Engine, requests: dict, prompts: list[list[int]], **params) -> dict[str, tuple]:
    """Every prompt with the base model and with each adapter, in one queue; request id -> (name, prompt idx)."""
    keys = {}
    for j, prompt in enumerate(prompts):
        for name in [None, *requests]:
            rid = f"{name}-{j}"
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                           **params),
                               lora_request=requests[name] if name else None)
            keys[rid] = (name, j)
    return keys


# ---- exactness --------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [None, "default"])
def test_one_batch_of_base_and_three_adapters_matches_peft_greedy(lora_setup, spec):
    path, requests, prompts, oracle, _ = lora_setup
    kwargs = {} if spec == "default" else {"speculative_config": None}
    engine = _engine(path, max_loras=3, **kwargs)
    keys = _add_all(engine, requests, prompts)
    finished = _run(engine)
    for rid, key in keys.items():
        assert finished[rid].outputs[0].token_ids == oracle[key], key


@torch.inference_mode()
def test_first_token_logprobs_match_peft(lora_setup):
    path, requests, prompts, _, models = lora_setup
    engine = _engine(path, max_loras=3, speculative_config=None)
    for name, lora in requests.items():
        engine.add_request(name, prompts[0], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                           lora_request=lora)
    finished = _run(engine)
    for name, model in models.items():
        ref = torch.log_softmax(model(input_ids=torch.tensor([prompts[0]])).logits[0, -1].float(), -1)
        got = finished[name].outputs[0].logprobs[0]
        assert len(got) >= 5
        for token, lp in got.items():
            assert abs(lp.logprob - ref[token].item()) < 1e-4, (name, token)


def test_more_adapters_than_slots_swap_and_stay_exact(lora_setup):
    path, requests, prompts, oracle, _ = lora_setup
    engine = _engine(path, max_loras=2, max_cpu_loras=2, speculative_config=None)
    keys = _add_all(engine, requests, prompts)
    finished = _run(engine)  # check_invariants asserts <= 2 adapters among running requests every step
    for rid, key in keys.items():
        assert finished[rid].outputs[0].token_ids == oracle[key], key
    lora = engine.core.executor.worker.lora
    assert lora.num_slot_loads > len(requests)      # slots were reused
    assert lora.num_disk_loads > len(requests)      # the host cache (2 adapters) evicted and reloaded


def test_preemption_with_adapters_recomputes_the_same_tokens(lora_setup):
    path, requests, prompts, oracle, _ = lora_setup
    engine = _engine(path, max_loras=2, num_gpu_blocks_override=12, speculative_config=None)
    keys = _add_all(engine, requests, prompts)
    finished = _run(engine)
    assert engine.scheduler.stats.num_preemptions > 0
    for rid, key in keys.items():
        assert finished[rid].outputs[0].token_ids == oracle[key], key


def test_llm_generate_takes_one_lora_request_per_prompt(lora_setup):
    path, requests, prompts, oracle, _ = lora_setup
    llm = LLM(path, enable_lora=True, max_loras=2, num_gpu_blocks_override=128, block_size=8)
    loras = [None, requests["attn"], requests["all"]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                        use_tqdm=False, lora_request=loras)
    for j, (out, lora) in enumerate(zip(outs, loras)):
        assert out.outputs[0].token_ids == oracle[(lora.lora_name if lora else None, j)]


# ---- prefix cache -----------------------------------------------------------------------------------
def test_prefix_cache_hits_within_an_adapter_never_across(lora_setup):
    path, requests, _, _, _ = lora_setup
    engine = _engine(path, max_loras=2, speculative_config=None)
    prompt = list(range(100, 141))  # 41 tokens: 5 full blocks of 8 can be reused
    order = [("a1", "attn"), ("b1", "all"), ("base1", None), ("a2", "attn"), ("b2", "all"), ("base2", None)]
    cached = {}
    for rid, name in order:  # one at a time, so each finds what the earlier ones cached
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                           lora_request=requests[name] if name else None)
        cached[rid] = _run(engine)[rid].num_cached_tokens
    assert cached["a1"] == cached["b1"] == cached["base1"] == 0
    assert cached["a2"] == cached["b2"] == cached["base2"] == 40


# ---- admission --------------------------------------------------------------------------------------
def _copy_adapter(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)


def test_bad_adapters_raise_value_error_naming_the_problem(lora_setup, tmp_path):
    from safetensors.torch import load_file, save_file

    path, requests, prompts, _, _ = lora_setup
    engine = _engine(path, max_loras=1, max_lora_rank=8, speculative_config=None)
    src = requests["attn"].lora_path
    params = SamplingParams(max_tokens=2)

    def refuse(lora_path: str, match: str, lora_id: int = 7):
        with pytest.raises(ValueError, match=match):
            engine.add_request(f"r{lora_id}", prompts[0], params, lora_request=LoRARequest("bad", lora_id, lora_path))

    big = _copy_adapter(src, str(tmp_path / "big"))
    _edit_config(big, r=16)
    refuse(big, "rank 16 is over max_lora_rank 8")
    small = _copy_adapter(src, str(tmp_path / "small"))
    _edit_config(small, r=4)
    refuse(small, r"lora_A \(8, 64\).*another base model", 8)  # config and tensors disagree -> shapes
    alien = _copy_adapter(src, str(tmp_path / "alien"))
    _edit_config(alien, target_modules=["q_proj", "c_attn"])
    refuse(alien, "c_attn", 9)
    missing = _copy_adapter(src, str(tmp_path / "missing"))
    os.remove(os.path.join(missing, "adapter_model.safetensors"))
    refuse(missing, "missing file adapter_model.safetensors", 10)
    refuse(str(tmp_path / "nowhere"), "no such folder", 11)
    wide = _copy_adapter(src, str(tmp_path / "wide"))  # an adapter of a model with hidden size 32
    file = os.path.join(wide, "adapter_model.safetensors")
    save_file({k: (v[:, :32] if "lora_A" in k else v).contiguous() for k, v in load_file(file).items()}, file)
    refuse(wide, "another base model", 12)
    assert not engine.has_unfinished_requests()  # nothing was queued

    off = Engine(EngineArgs(model=path, num_gpu_blocks_override=32, speculative_config=None))
    with pytest.raises(ValueError, match="enable_lora"):
        off.add_request("x", prompts[0], params, lora_request=requests["attn"])


def test_bin_adapters_load_like_safetensors(lora_setup, tmp_path):
    from safetensors.torch import load_file

    from kvserve.lora.adapter import load_adapter

    path, requests, _, _, _ = lora_setup
    src = requests["mlp_rs"].lora_path
    binary = _copy_adapter(src, str(tmp_path / "bin"))
    file = os.path.join(binary, "adapter_model.safetensors")
    torch.save(load_file(file), os.path.join(binary, "adapter_model.bin"))
    os.remove(file)
    hf = EngineArgs(model=path).create_engine_config().model.hf_config
    a = load_adapter(requests["mlp_rs"], hf, 16)
    b = load_adapter(LoRARequest("bin", 2, binary), hf, 16)
    assert a.scaling == b.scaling == pytest.approx(16 / 8 ** 0.5)  # rsLoRA
    assert a.weights.keys() == b.weights.keys()
    assert all(torch.equal(a.weights[k][0], b.weights[k][0]) for k in a.weights)


# ---- scheduling -------------------------------------------------------------------------------------
def test_scheduler_admits_at_most_max_loras_adapters_in_fcfs_order(tmp_path):
    from kvserve.config.scheduler import SchedulerConfig
    from kvserve.core_types import ModelRunnerOutput
    from kvserve.kv_cache.block_pool import BlockPool
    from kvserve.kv_cache.manager import KVCacheManager
    from kvserve.request import Request
    from kvserve.scheduler.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(8, 64, 4096), KVCacheManager(BlockPool(32), 4, True), max_loras=2)
    loras = {i: LoRARequest(f"a{i}", i, str(tmp_path)) for i in (1, 2, 3)}
    order = [("x", 1), ("y", 2), ("base", 0), ("z", 3), ("x2", 1)]
    for rid, lid in order:
        sched.add_request(Request(rid, [5, 6, 7], SamplingParams(max_tokens=1), max_tokens=1,
                                  lora_request=loras.get(lid)))
    out = sched.schedule()
    # "z" would be a third adapter: it waits at the head of the queue, and "x2" (a running adapter) behind it
    assert list(out.num_scheduled_tokens) == ["x", "y", "base"]
    assert [n.lora_request for n in out.scheduled_new_reqs] == [loras[1], loras[2], None]
    sched.check_invariants()
    sched.update(out, ModelRunnerOutput(req_ids=["x", "y", "base"], sampled_token_ids=[[9], [9], [9]]))  # all finish
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["z", "x2"]
    sched.check_invariants()
