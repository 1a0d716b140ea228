"""The pull connector's TCP side channel: a prefill instance serves its finished requests' KV blocks, a decode
instance reads them and then says it is done.

Every message is a header (4-byte big-endian length, then JSON) and, for a read's answer, a payload of
`nbytes` raw bytes. The ops:
  {"op": "read", "request_id": R, "block_ids": [...]} -> {"ok": true, "layers": [[[name, dtype, shape], ...], ...],
      "nbytes": N, "crc32": C} + payload: for each layer, each part (values, then scales of a quantized
      cache), the blocks in the order asked, contiguous; or {"ok": false, "error": "..."}.
  {"op": "notify", "request_id": R} -> {"ok": true}: the reader is done; the server drops R's blocks.
One connection per transfer: a read, then (on the same connection) its notify.
"""
from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("kvserve")

_LEN = struct.Struct(">I")
_CHUNK = 1 << 20
MAX_HEADER_BYTES = 1 << 20


class TransferError(Exception):
    """A transfer failed: unreachable, dropped, timed out, refused by the server, or corrupt."""


@dataclass
class Snapshot:
    """What a read sends: the layers' layout and the payload's parts, copied out of the cache under the lock."""
    layers: list[list[list]]
    parts: list[torch.Tensor]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def snapshot_blocks(kv_caches: list, block_ids: list[int]) -> Snapshot:
    """Copies of `block_ids` in every layer (values, and scales of a quantized cache), in the wire's order."""
    layers, parts = [], []
    for kv_layer in kv_caches:
        scales = getattr(kv_layer, "scales", None)
        named = [("values", kv_layer.values), ("scales", scales)] if scales is not None else [("values", kv_layer)]
        desc = []
        for name, tensor in named:
            idx = torch.tensor(block_ids, dtype=torch.int64, device=tensor.device)
            part = tensor.index_select(0, idx).to("cpu").contiguous()
            desc.append([name, _dtype_name(tensor.dtype), list(tensor.shape[1:])])
            parts.append(part)
        layers.append(desc)
    return Snapshot(layers, parts)


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def send_msg(sock: socket.socket, header: dict, parts: list[torch.Tensor] = ()) -> None:
    data = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(data)) + data)
    for part in parts:
        sock.sendall(_as_bytes(part))


def _recv_exact(sock: socket.socket, n: int, deadline: float, cancelled: threading.Event | None) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if cancelled is not None and cancelled.is_set():
            raise TransferError("cancelled")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError("timed out")
        sock.settimeout(min(left, 1.0))
        try:
            k = sock.recv_into(view[got:], min(n - got, _CHUNK))
        except TimeoutError:
            continue
        if k == 0:
            raise TransferError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv_msg(sock: socket.socket, deadline: float, cancelled: threading.Event | None = None) -> dict:
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline, cancelled))
    if length > MAX_HEADER_BYTES:
        raise TransferError(f"header of {length} bytes")
    return json.loads(bytes(_recv_exact(sock, length, deadline, cancelled)))


def payload_checksum(parts: list[torch.Tensor]) -> int:
    """CRC-32 of the payload: it is there to catch a corrupt or truncated transfer, not a forger, and a CRC costs
    less than a cryptographic hash on a long prompt's megabytes."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(_as_bytes(part), crc)
    return crc


class BlockServer:
    """Serves reads of registered requests' blocks from a background thread. `snapshot(request_id, block_ids)`
    copies the blocks out (or raises KeyError: not served); `notified(request_id)` is called when the reader
    is done. `wait_s`: how long a read waits for its request to be registered (the prefill engine registers
    it at the step after the request finished, and the answer may reach the reader first)."""

    def __init__(self, host: str, port: int, snapshot: Callable[[str, list[int]], Snapshot],
                 notified: Callable[[str], None], wait_s: float):
        self.snapshot, self.notified, self.wait_s = snapshot, notified, wait_s
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                server._serve(self.request)

        try:
            self._tcp = socketserver.ThreadingTCPServer((host, port), Handler, bind_and_activate=False)
            self._tcp.daemon_threads = True
            self._tcp.allow_reuse_address = True
            self._tcp.server_bind()
            self._tcp.server_activate()
        except OSError as e:
            raise ValueError(f"kv_transfer_config: the KV side channel cannot listen on {host}:{port}: {e.strerror} "
                             "(set kv_port; 0 picks a free port)") from None
        self.host, self.port = self._tcp.server_address[:2]
        self._thread = threading.Thread(target=self._tcp.serve_forever, name="kv-pull-server", daemon=True)
        self._thread.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            while True:
                try:
                    msg = recv_msg(sock, time.monotonic() + 3600)
                except (TransferError, OSError, ValueError):
                    return
                if msg.get("op") == "read":
                    self._read(sock, str(msg.get("request_id")), [int(b) for b in msg.get("block_ids", [])])
                elif msg.get("op") == "notify":
                    self.notified(str(msg.get("request_id")))
                    send_msg(sock, {"ok": True})
                else:
                    send_msg(sock, {"ok": False, "error": f"unknown op {msg.get('op')!r}"})
        except OSError:
            return  # the reader went away

    def _read(self, sock: socket.socket, request_id: str, block_ids: list[int]) -> None:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                snap = self.snapshot(request_id, block_ids)
                break
            except TransferError as e:
                send_msg(sock, {"ok": False, "error": str(e)})
                return
            except KeyError as e:
                if time.monotonic() >= deadline:
                    send_msg(sock, {"ok": False, "error": str(e.args[0])})
                    return
                time.sleep(0.005)
        header = {"ok": True, "layers": snap.layers, "nbytes": sum(p.numel() * p.element_size() for p in snap.parts),
                  "crc32": payload_checksum(snap.parts)}
        send_msg(sock, header, snap.parts)

    def close(self) -> None:
        self._tcp.shutdown()
        self._tcp.server_close()


def connect(host: str, port: int, deadline: float) -> socket.socket:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError("timed out")
    try:
        sock = socket.create_connection((host, port), timeout=min(left, 10.0))
    except OSError as e:
        raise TransferError(f"cannot reach {host}:{port}: {e.strerror or e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_blocks(sock: socket.socket, request_id: str, block_ids: list[int], deadline: float,
                cancelled: threading.Event | None) -> tuple[list, bytearray]:
    """(layers' layout, payload) of one read, its checksum verified."""
    try:
        send_msg(sock, {"op": "read", "request_id": request_id, "block_ids": block_ids})
        header = recv_msg(sock, deadline, cancelled)
        if not header.get("ok"):
            raise TransferError(f"the prefill instance refused: {header.get('error')}")
        payload = _recv_exact(sock, int(header["nbytes"]), deadline, cancelled)
    except OSError as e:
        raise TransferError(f"connection lost: {e.strerror or e}") from None
    if zlib.crc32(payload) != header.get("crc32"):
        raise TransferError("checksum mismatch (the transfer is corrupt)")
    return header["layers"], payload


def notify(sock: socket.socket, request_id: str, deadline: float) -> None:
    """Tell the server the reader is done with request_id's blocks (best effort: its lease frees them anyway)."""
    try:
        send_msg(sock, {"op": "notify", "request_id": request_id})
        recv_msg(sock, min(deadline, time.monotonic() + 5.0))
    except (OSError, TransferError) as e:
        logger.warning("KV pull: could not tell the prefill instance that request %s was read: %s", request_id, e)


def split_payload(layers: list, payload: bytearray, num_blocks: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The payload as tensors, per layer: [(part name, [num_blocks, *block shape])]."""
    out, offset = [], 0
    for desc in layers:
        parts = []
        for name, dtype_name, shape in desc:
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise TransferError(f"unknown dtype {dtype_name!r}")
            count = num_blocks * int(torch.Size(shape).numel()) * dtype.itemsize
            if offset + count > len(payload):
                raise TransferError("payload shorter than its layout")
            raw = torch.frombuffer(payload, dtype=torch.uint8, count=count, offset=offset)
            parts.append((name, raw.view(dtype).view(num_blocks, *shape)))
            offset += count
        out.append(parts)
    if offset != len(payload):
        raise TransferError("payload longer than its layout")
    return out
