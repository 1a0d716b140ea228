"""The pull connector's TCP side channel: a prefill instance serves its finished requests' KV blocks, a decode
instance reads them and then says it is done.

Every message is a header: a 4-byte big-endian length, then JSON. The ops:
  {"op": "read", "request_id": R, "block_ids": [...]} -> {"ok": true, "layers": [[[name, dtype, block shape], ...],
      ...], "nbytes": N}, then N raw bytes: for each layer, each part (values, then scales of a quantized cache),
      each block in the order asked; then {"crc32": C} over those bytes. Or {"ok": false, "error": "..."}.
  {"op": "notify", "request_id": R} -> {"ok": true}: the reader is done; the server drops R's blocks.
One connection per transfer: a read, then (on the same connection) its notify. Blocks go from the cache to the
socket and from the socket into the cache with no copy in between (a block is contiguous in a block-first cache);
the reader writes into blocks only its own parked request owns, so a transfer found corrupt at the end is simply
a load error.
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
from collections.abc import Callable, Iterator

import torch

logger = logging.getLogger("kvserve")

_LEN = struct.Struct(">I")
_CHUNK = 1 << 20
MAX_HEADER_BYTES = 1 << 20


class TransferError(Exception):
    """A transfer failed: unreachable, dropped, timed out, refused by the server, or corrupt."""

    def __init__(self, message: str, *, read_whole: bool = False):
        super().__init__(message)
        self.read_whole = read_whole
        """The answer was read to its end (the connection can still carry the notify)."""


def layer_parts(kv_layer) -> list[tuple[str, torch.Tensor]]:
    """One layer's cache as the wire names its parts: values, and the scales of a quantized cache."""
    scales = getattr(kv_layer, "scales", None)
    return [("values", kv_layer.values), ("scales", scales)] if scales is not None else [("values", kv_layer)]


def layout(kv_caches: list) -> list[list[list]]:
    return [[[name, str(t.dtype).removeprefix("torch."), list(t.shape[1:])] for name, t in layer_parts(layer)]
            for layer in kv_caches]


def block_views(kv_caches: list, block_ids: list[int]) -> Iterator[torch.Tensor]:
    """Each block of each part of each layer, in the wire's order (views into the cache)."""
    for layer in kv_caches:
        for _, tensor in layer_parts(layer):
            for b in block_ids:
                yield tensor[b]


def payload_bytes(kv_caches: list, num_blocks: int) -> int:
    return sum(t[0].numel() * t.element_size() for layer in kv_caches for _, t in layer_parts(layer)) * num_blocks


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy for a contiguous CPU tensor."""
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def send_msg(sock: socket.socket, header: dict) -> None:
    data = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def send_block(sock: socket.socket, data: memoryview) -> None:
    """One block's bytes (a seam of its own: the fault tests drop or corrupt them here)."""
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int, deadline: float, cancelled: threading.Event | None) -> bytearray:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), deadline, cancelled)
    return buf


def _recv_into(sock: socket.socket, view: memoryview, deadline: float, cancelled: threading.Event | None) -> None:
    n, got = len(view), 0
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


def recv_msg(sock: socket.socket, deadline: float, cancelled: threading.Event | None = None) -> dict:
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline, cancelled))
    if length > MAX_HEADER_BYTES:
        raise TransferError(f"header of {length} bytes")
    return json.loads(bytes(_recv_exact(sock, length, deadline, cancelled)))


class BlockServer:
    """Serves reads of registered requests' blocks from a background thread. `begin_read(request_id, block_ids)`
    returns the KV caches to read them from (raises KeyError: not registered yet, TransferError: not served) and
    keeps them served until `end_read(request_id)`; `notified(request_id)` is called when the reader is done.
    `wait_s`: how long a read waits for its request to be registered (the prefill engine registers it at the step
    after the request finished, and the answer may reach the reader first)."""

    def __init__(self, host: str, port: int, begin_read: Callable[[str, list[int]], list],
                 end_read: Callable[[str], None], notified: Callable[[str], None], wait_s: float):
        self.begin_read, self.end_read, self.notified, self.wait_s = begin_read, end_read, notified, wait_s
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
                kv_caches = self.begin_read(request_id, block_ids)
                break
            except TransferError as e:
                send_msg(sock, {"ok": False, "error": str(e)})
                return
            except KeyError as e:
                if time.monotonic() >= deadline:
                    send_msg(sock, {"ok": False, "error": str(e.args[0])})
                    return
                time.sleep(0.005)
        try:
            send_msg(sock, {"ok": True, "layers": layout(kv_caches),
                            "nbytes": payload_bytes(kv_caches, len(block_ids))})
            crc = 0
            for block in block_views(kv_caches, block_ids):
                data = _as_bytes(block)
                crc = zlib.crc32(data, crc)
                send_block(sock, data)
            send_msg(sock, {"crc32": crc})
        finally:
            self.end_read(request_id)

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


def read_into(sock: socket.socket, request_id: str, remote_block_ids: list[int], kv_caches: list,
              local_block_ids: list[int], deadline: float, cancelled: threading.Event | None) -> int:
    """Read the remote blocks straight into `local_block_ids` of `kv_caches`; returns the payload's bytes. The
    CRC-32 (a corrupt or truncated transfer, not a forger: cheaper than a cryptographic hash on a long prompt's
    megabytes) is checked at the end, so a TransferError may leave those blocks half written."""
    try:
        send_msg(sock, {"op": "read", "request_id": request_id, "block_ids": remote_block_ids})
        header = recv_msg(sock, deadline, cancelled)
        if not header.get("ok"):
            raise TransferError(f"the prefill instance refused: {header.get('error')}")
        nbytes = int(header["nbytes"])
        mine = layout(kv_caches)
        if header["layers"] != mine or nbytes != payload_bytes(kv_caches, len(local_block_ids)):
            _drain(sock, nbytes, deadline, cancelled)  # so that the notify that follows is read
            raise TransferError(f"the prefill instance's KV cache layout {header['layers'][:1]} (first layer of "
                                f"{len(header['layers'])}) is not this instance's {mine[:1]} (of {len(mine)}): same "
                                "model, block size and kv_cache_dtype on both sides?", read_whole=True)
        crc = 0
        for dest in block_views(kv_caches, local_block_ids):
            crc = _recv_block(sock, dest, crc, deadline, cancelled)
        trailer = recv_msg(sock, deadline, cancelled)
    except OSError as e:
        raise TransferError(f"connection lost: {e.strerror or e}") from None
    if trailer.get("crc32") != crc:
        raise TransferError("checksum mismatch (the transfer is corrupt)", read_whole=True)
    return nbytes


def _recv_block(sock: socket.socket, dest: torch.Tensor, crc: int, deadline: float,
                cancelled: threading.Event | None) -> int:
    direct = dest.device.type == "cpu" and dest.is_contiguous()
    staging = dest if direct else torch.empty(dest.shape, dtype=dest.dtype)
    view = memoryview(staging.reshape(-1).view(torch.uint8).numpy())
    _recv_into(sock, view, deadline, cancelled)
    if not direct:
        dest.copy_(staging)
    return zlib.crc32(view, crc)


def _drain(sock: socket.socket, nbytes: int, deadline: float, cancelled: threading.Event | None) -> None:
    scratch = memoryview(bytearray(min(nbytes, _CHUNK) or 1))
    while nbytes > 0:
        n = min(nbytes, len(scratch))
        _recv_into(sock, scratch[:n], deadline, cancelled)
        nbytes -= n
    recv_msg(sock, deadline, cancelled)


def notify(sock: socket.socket, request_id: str, deadline: float) -> None:
    """Tell the server the reader is done with request_id's blocks (best effort: its lease frees them anyway)."""
    try:
        send_msg(sock, {"op": "notify", "request_id": request_id})
        recv_msg(sock, min(deadline, time.monotonic() + 5.0))
    except (OSError, TransferError) as e:
        logger.warning("KV pull: could not tell the prefill instance that request %s was read: %s", request_id, e)
