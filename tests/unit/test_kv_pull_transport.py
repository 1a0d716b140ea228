"""The pull connector's side channel without a model: blocks of every KV dtype (values and scales) arrive byte for
byte; a read of an unregistered request, of another request's blocks or after the lease is refused with the reason;
a notify or an expired lease ends the serving; a layout mismatch, a corrupt payload and a cancelled pull are
TransferErrors."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kvserve.kv_cache.quant import QuantizedKVCache
from kvserve.kv_transfer.connectors import pull_transport
from kvserve.kv_transfer.connectors.pull_transport import BlockServer, TransferError, connect
from kvserve.kv_transfer.connectors.pull_worker import PullSpec, ServedBlocks, pull_into


def _caches(dtype: torch.dtype, seed: int, num_layers: int = 3, num_blocks: int = 8) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_layers):
        raw = torch.randn(num_blocks, 4, 2, 2, 8, generator=g)
        if dtype == torch.int8:
            out.append(QuantizedKVCache((raw * 40).to(torch.int8), torch.rand(num_blocks, 2, 2, generator=g).to(
                torch.bfloat16)))
        elif dtype == torch.float8_e4m3fn:
            out.append(QuantizedKVCache(raw.to(dtype), torch.rand(num_blocks, 2, 2, generator=g).to(torch.bfloat16)))
        else:
            out.append(raw.to(dtype))
    return out


def _parts(layer) -> list[torch.Tensor]:
    return [layer.values, layer.scales] if isinstance(layer, QuantizedKVCache) else [layer]


@pytest.fixture
def served():
    blocks = ServedBlocks(lease_s=60)
    server = BlockServer("127.0.0.1", 0, blocks.begin_read, blocks.end_read, blocks.notified, wait_s=0.2)
    yield blocks, server
    server.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_blocks_arrive_byte_for_byte_and_a_notify_ends_the_serving(served, dtype):
    blocks, server = served
    blocks.kv_caches = _caches(dtype, seed=1)
    mine = _caches(dtype, seed=2)
    blocks.add("r", [5, 2, 7])
    spec = PullSpec("d", [0, 3, 1], [5, 2, 7], "127.0.0.1", server.port, "r")
    assert pull_into(mine, spec, time.monotonic() + 10, threading.Event()) > 0
    for theirs, ours in zip(blocks.kv_caches, mine):
        for a, b in zip(_parts(theirs), _parts(ours)):
            assert torch.equal(a[[5, 2, 7]].view(torch.uint8), b[[0, 3, 1]].view(torch.uint8))
    assert blocks.finished() == {"r"} and blocks.finished() == set()
    with pytest.raises(TransferError, match="no longer served here \\(already read\\)"):
        pull_into(mine, spec, time.monotonic() + 10, threading.Event())


def test_refusals_name_their_reason(served):
    blocks, server = served
    blocks.kv_caches = _caches(torch.float32, seed=1)
    with pytest.raises(TransferError, match="unknown request id"):
        pull_into(_caches(torch.float32, 2), PullSpec("d", [0], [1], "127.0.0.1", server.port, "nobody"),
                  time.monotonic() + 10, threading.Event())
    blocks.add("r", [1, 2])
    with pytest.raises(TransferError, match=r"blocks \[3\] are not request r's"):
        pull_into(_caches(torch.float32, 2), PullSpec("d", [0, 1], [2, 3], "127.0.0.1", server.port, "r"),
                  time.monotonic() + 10, threading.Event())
    blocks.lease_s = 0.0
    blocks.add("short", [4])
    assert blocks.finished() == {"short"}  # its lease expired
    with pytest.raises(TransferError, match="lease of 0 s expired"):
        pull_into(_caches(torch.float32, 2), PullSpec("d", [0], [4], "127.0.0.1", server.port, "short"),
                  time.monotonic() + 10, threading.Event())
    with pytest.raises(TransferError, match="cannot reach"):
        connect("127.0.0.1", 1, time.monotonic() + 5)


def _pull(server, req_id: str, dest: list, cancelled: threading.Event | None = None) -> int:
    return pull_into(dest, PullSpec("d", [0], [1], "127.0.0.1", server.port, req_id), time.monotonic() + 10,
                     cancelled or threading.Event())


def test_layout_mismatch_corruption_and_cancel(served, monkeypatch):
    blocks, server = served
    blocks.kv_caches = _caches(torch.float32, seed=1)
    blocks.add("r", [1])
    with pytest.raises(TransferError, match="layout"):
        _pull(server, "r", _caches(torch.int8, 2))
    assert blocks.finished() == {"r"}  # read to its end all the same: the prefill side frees it
    real = pull_transport.send_block

    def corrupt(sock, data):
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0xFF
        real(sock, memoryview(flipped))

    monkeypatch.setattr(pull_transport, "send_block", corrupt)
    blocks.add("r2", [1])
    with pytest.raises(TransferError, match="checksum"):
        _pull(server, "r2", _caches(torch.float32, 2))
    assert blocks.finished() == {"r2"}
    monkeypatch.setattr(pull_transport, "send_block", real)
    cancelled = threading.Event()
    cancelled.set()
    blocks.add("r3", [1])
    with pytest.raises(TransferError, match="cancelled"):
        _pull(server, "r3", _caches(torch.float32, 2), cancelled)
    assert blocks.finished() == set()  # not read: served until its lease
