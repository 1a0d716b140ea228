"""--kv-transfer-config: vLLM's keys, validated at start-up (unknown keys and bad values are errors that name
them); the connector factory's names; the block digests that name stored prefixes."""
from __future__ import annotations

import json

import pytest

from kvserve.cli.main import main
from kvserve.config import EngineArgs
from kvserve.config.kv_transfer import KVTransferConfig
from kvserve.kv_transfer.block_keys import BlockDigests
from kvserve.kv_transfer.factory import KVConnectorFactory
from kvserve.lora.request import LoRARequest
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

VLLM_KEYS = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", "kv_rank": 0, "kv_parallel_size": 2,
             "kv_ip": "10.0.0.1", "kv_port": 14579, "engine_id": "e0", "kv_buffer_device": "cpu",
             "kv_buffer_size": 1e9, "kv_connector_module_path": None, "kv_load_failure_policy": "fail",
             "kv_connector_extra_config": {"shared_storage_path": "/dev/shm/kv"}}


def test_every_vllm_key_is_accepted_from_json_and_dict():
    for value in (json.dumps(VLLM_KEYS), VLLM_KEYS):
        cfg = KVTransferConfig.parse(value)
        assert cfg.kv_connector == "SharedStorageConnector" and cfg.kv_load_failure_policy == "fail"
        assert cfg.is_kv_producer and cfg.is_kv_consumer
    assert KVTransferConfig.parse(None) is None and KVTransferConfig.parse("") is None
    assert KVTransferConfig.parse({"kv_connector": "X", "kv_role": "kv_consumer"}).kv_load_failure_policy == "recompute"


@pytest.mark.parametrize("value, match", [
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", "kv_conector_extra": {}}, "kv_conector_extra"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "both"}, "kv_role must be one of"),
    ({"kv_connector": "SharedStorageConnector"}, "kv_role .* is required"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", "kv_load_failure_policy": "retry"},
     "kv_load_failure_policy must be one of"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", "kv_connector_extra_config": []},
     "must be a JSON object"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", "kv_port": -1}, "kv_port"),
    ("{not json", "must be a JSON object"),
    ("[1]", "must be a JSON object"),
])
def test_bad_config_is_an_error_naming_it(value, match):
    with pytest.raises(ValueError, match=match):
        KVTransferConfig.parse(value)
    with pytest.raises(ValueError, match=match):
        EngineArgs(kv_transfer_config=value)


def test_cli_flag_error_is_reported_not_raised(capsys):
    assert main(["generate", "--kv-transfer-config", '{"kv_connector": "SharedStorageConnector", "bogus": 1}',
                 "hi"]) == 2
    assert "unknown kv_transfer_config key(s): bogus" in capsys.readouterr().err


def test_factory_knows_vllm_names():
    assert {"SharedStorageConnector", "ExampleConnector", "OffloadingConnector",
            "MultiConnector"} <= set(KVConnectorFactory.names())


def _req(rid: str, tokens: list[int], salt: str | None = None, lora: LoRARequest | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), cache_salt=salt, lora_request=lora)


def test_block_digests_chain_the_prefix_and_keep_salts_and_adapters_apart():
    digests = BlockDigests("ns", block_size=4)
    a = digests.of(_req("a", list(range(12))), 3)
    b = digests.of(_req("b", list(range(8)) + [99, 98, 97, 96]), 3)
    assert a[:2] == b[:2] and a[2] != b[2] and len(set(a)) == 3
    assert digests.of(_req("c", [5] + list(range(1, 12))), 3)[1] != a[1]  # a changed parent changes its children
    assert digests.of(_req("s", list(range(12)), salt="tenant"), 1)[0] != a[0]
    lora = LoRARequest("sql", 1, "/adapters/sql")
    assert digests.of(_req("l", list(range(12)), lora=lora), 1)[0] != a[0]
    assert BlockDigests("other-model", 4).of(_req("a2", list(range(12))), 1)[0] != a[0]
    assert BlockDigests("ns", 4).of(_req("a3", list(range(12))), 3) == a  # stable: a new instance agrees
