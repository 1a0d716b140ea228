"""PullConnector (registered as vLLM's "NixlConnector" too): disaggregated prefill, the decode instance pulls the
prompt's KV from the prefill instance over TCP (NIXL's request flow and kv_transfer_params, not its transport).

Prefill side (kv_producer / kv_both): a request with kv_transfer_params {"do_remote_decode": true} keeps its
blocks when it finishes, and its response's kv_transfer_params say where they are: {"do_remote_prefill": true,
"do_remote_decode": false, "remote_block_ids", "remote_engine_id", "remote_host", "remote_port",
"remote_request_id", "tp_size"}. The worker serves them on a TCP side channel (kv_ip:kv_port; port 0 picks a free
one) until the reader says it is done or the lease (kv_connector_extra_config "lease_s", vLLM's
VLLM_NIXL_ABORT_REQUEST_TIMEOUT's 480 s by default) expires.
Decode side (kv_consumer / kv_both): a request whose kv_transfer_params say do_remote_prefill loads its prompt's
KV asynchronously: the scheduler parks it (WAITING_FOR_REMOTE_KVS) holding its blocks, the worker pulls them in
the background (every layer, values and scales, a CRC-32 per transfer; "timeout_s", at most the lease, bounds
it) and reports it in finished_recving; the request then resumes as a prefix hit. A failed pull is a load error
(kv_load_failure_policy: recompute or fail). The local prefix cache is read first: only the blocks it misses are
pulled. With nothing to pull, the prefill instance is still told to free its blocks.
Tensor parallelism (equal sizes on both sides): rank r serves and pulls its own KV heads, from the other side's
rank r (which listens on kv_port + r, or on a free port; "remote_ports", kvserve's key, lists them); the ranks
agree (a sum over ranks each step) that a pull or a send ended on all of them before it is reported, and a pull
that failed on any rank failed on all.
"""
from __future__ import annotations

import logging
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.config.engine import EngineConfig
from kvserve.config.kv_transfer import KVTransferConfig
from kvserve.core_types import KVConnectorOutput, SchedulerOutput
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.kv_cache.quant import is_quantized, resolve_kv_cache_dtype
from kvserve.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvserve.kv_transfer.connectors.pull_transport import BlockServer
from kvserve.kv_transfer.connectors.pull_worker import PullJobs, PullSpec, ServedBlocks, SlotKeys
from kvserve.kv_transfer.extra_config import check_extra_keys
from kvserve.request import Request, RequestStatus

logger = logging.getLogger("kvserve")

DEFAULT_LEASE_S = 480.0
"""vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT: how long a prefill instance keeps blocks nobody reads."""
_KEYS = ("lease_s", "timeout_s", "backends")
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


@dataclass
class PullMetadata(KVConnectorMetadata):
    recv: list[PullSpec] = field(default_factory=list)
    send: dict[str, list[int]] = field(default_factory=dict)
    """Finished requests whose blocks to serve, by request id."""
    cancel: list[str] = field(default_factory=list)
    """Requests finished (aborted) while their pull runs: stop it."""


@dataclass(frozen=True)
class _Remote:
    block_ids: list[int]
    host: str
    port: int
    request_id: str
    first_block: int
    """The first block to pull (the ones before are a local prefix-cache hit)."""
    ports: tuple[int, ...] = ()
    """Each tensor-parallel rank's port (kvserve's "remote_ports"); empty: remote_port + rank."""

    def spec(self, req_id: str, local_block_ids: list[int], remote_block_ids: list[int]) -> PullSpec:
        return PullSpec(req_id, local_block_ids, remote_block_ids, self.host, self.port, self.request_id, self.ports)


def _seconds(extra: dict, key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"kv_transfer_config: kv_connector_extra_config.{key} must be a positive number of "
                         f"seconds, got {value!r}")
    return float(value)


class PullConnector(KVConnectorBase_V1):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_spec: KVCacheSpec | None = None):
        super().__init__(config, role, kv_spec)
        extra = check_extra_keys(self.transfer, _KEYS)
        self.lease_s = _seconds(extra, "lease_s", DEFAULT_LEASE_S)
        self.timeout_s = min(_seconds(extra, "timeout_s", self.lease_s), self.lease_s)
        self.block_size = config.cache.block_size
        self.quantized_kv = is_quantized(resolve_kv_cache_dtype(config.cache.kv_cache_dtype, config.model.dtype))
        self.engine_id = self.transfer.engine_id or f"kvserve-{uuid.uuid4().hex[:12]}"
        if self.transfer.kv_connector == "NixlConnector" and role == KVConnectorRole.WORKER:
            logger.info("NixlConnector: kvserve moves the KV over TCP (its PullConnector), not NIXL")
        # scheduler side
        self.side_channel: tuple[str, int] | None = None
        """(host, port) the worker serves blocks on, from its handshake metadata (prefill side)."""
        self._rank_ports: list[int] = []
        """Every rank's side-channel port (rank r serves its own heads): the scheduler side's from the handshake,
        the worker side's from the ranks' sum."""
        self._pending: dict[str, _Remote] = {}
        self._pulled: set[str] = set()  # requests whose remote KV was asked for: never twice
        self._inflight: set[str] = set()
        self._meta = PullMetadata()
        # worker side
        self._served = ServedBlocks(self.lease_s)
        self._jobs = PullJobs(self.timeout_s)
        self._server: BlockServer | None = None
        self._device = None
        self._recv_keys = self._send_keys = None  # tensor parallelism: SlotKeys, the ranks' agreement
        self._recv_ended: dict[str, tuple[PullSpec, bool]] = {}
        """Pulls that ended on this rank, (spec, failed), until every rank's has."""
        self._send_ended: set[str] = set()
        self._recv_done: set[str] = set()
        self._send_done: set[str] = set()
        self._errors: set[int] = set()

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        extra = check_extra_keys(config.kv_transfer, _KEYS)
        for key in ("lease_s", "timeout_s"):
            _seconds(extra, key, DEFAULT_LEASE_S)

    # ---- scheduler side ----------------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict | None) -> None:
        if metadata:
            self.side_channel = (metadata["host"], metadata["port"])
            self._rank_ports = list(metadata.get("ports", [metadata["port"]]))
            self.engine_id = metadata.get("engine_id", self.engine_id)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if (not self.transfer.is_kv_consumer or not params or not params.get("do_remote_prefill")
                or request.request_id in self._pulled):
            return 0, False
        remote = self._remote_of(request, params, num_computed_tokens // self.block_size)
        if remote is None:
            return 0, False
        end = min(len(remote.block_ids) * self.block_size, request.num_prompt_tokens - 1)
        if self.quantized_kv:
            # NOTE: a quantized block's scale follows how its tokens were written: the prompt's partial last
            # block is computed here in one chunk, as the prefill instance wrote it, so its codes are the same
            end -= end % self.block_size
        num = end - num_computed_tokens
        if num <= 0 or request.skip_reading_prefix_cache:  # nothing to read: the prefill instance may free them
            self._pulled.add(request.request_id)
            self._meta.recv.append(remote.spec(request.request_id, [], []))
            return 0, False
        self._pending[request.request_id] = remote
        return num, True

    def _remote_of(self, request: Request, params: dict, first_block: int) -> _Remote | None:
        ids, host, port = params.get("remote_block_ids"), params.get("remote_host"), params.get("remote_port")
        problem = None
        if not isinstance(ids, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in ids):
            problem = f"remote_block_ids must be a list of block ids, got {ids!r}"
        elif not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
            problem = f"remote_host/remote_port must be a host name and a port, got {host!r}, {port!r}"
        elif params.get("tp_size", self.tp_size) != self.tp_size:
            problem = (f"the prefill instance's tp_size {params.get('tp_size')} is not this instance's {self.tp_size}"
                       " (equal tensor-parallel sizes are required)")
        if problem is not None:
            logger.error("KV pull: request %s's kv_transfer_params are unusable, its prompt is computed here: %s",
                         request.request_id, problem)
            self._pulled.add(request.request_id)
            return None
        ports = params.get("remote_ports") or []
        if not isinstance(ports, list) or len(ports) != self.tp_size or not all(isinstance(p, int) for p in ports):
            ports = []
        remote_id = str(params.get("remote_request_id") or request.request_id)
        return _Remote(ids, host, port, remote_id, first_block, tuple(ports))

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        remote = self._pending.pop(request.request_id, None)
        if remote is None or not num_external_tokens:
            return
        first = remote.first_block
        last = -(-(first * self.block_size + num_external_tokens) // self.block_size)
        self._meta.recv.append(remote.spec(request.request_id, block_ids[first:last], remote.block_ids[first:last]))
        self._pulled.add(request.request_id)
        self._inflight.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PullMetadata:
        meta, self._meta = self._meta, PullMetadata()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._inflight -= connector_output.finished_recving

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._pending.pop(req_id, None)
        self._pulled.discard(req_id)
        if req_id in self._inflight:  # its blocks are written until the pull stops (finished_recving)
            self._meta.cancel.append(req_id)
            return True, None
        params = request.kv_transfer_params
        if not (self.transfer.is_kv_producer and params and params.get("do_remote_decode")
                and request.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)):
            return False, None
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        ids = list(block_ids[:-(-num_tokens // self.block_size)])
        if not ids or self.side_channel is None:
            return False, None
        self._meta.send[req_id] = ids
        host, port = self.side_channel
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": ids,
                  "remote_engine_id": self.engine_id, "remote_host": host, "remote_port": port,
                  "remote_request_id": req_id, "tp_size": self.tp_size}
        if self.tp_size > 1:
            params["remote_ports"] = self._rank_ports  # kvserve's: rank r reads rank r's heads there
        return True, params

    # ---- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list) -> None:
        self._served.kv_caches = kv_caches
        self._jobs.kv_caches = kv_caches
        self._jobs.rank = self.tp_rank
        first = kv_caches[0]
        values = first.values if getattr(first, "scales", None) is not None else first  # a QuantizedKVCache or not
        self._device = values.device
        if self.tp_all_reduce is not None:
            size = values.shape[0] + 1024  # transfers in flight: a parked request holds a block of its own
            self._recv_keys, self._send_keys = SlotKeys(size), SlotKeys(size)
        if self.transfer.is_kv_producer and self._server is None:
            self._server = self._listen()
            logger.info("KV pull: serving KV blocks on %s:%d (TCP)", self._server.host, self._server.port)
            self._rank_ports = self._share_ports(self._server.port)

    def _listen(self) -> BlockServer:
        host, port = self.transfer.kv_ip, self.transfer.kv_port
        served = self._served
        serve = dict(begin_read=served.begin_read, end_read=served.end_read, notified=served.notified,
                     wait_s=min(self.timeout_s, 30.0))
        try:
            return BlockServer(host, port + self.tp_rank if port else 0, **serve)
        except ValueError:
            if port != KVTransferConfig.kv_port:
                raise
            # NOTE: several producers on one host that all left kv_port at its default: the port is only ever
            # read from kv_transfer_params, so any free one serves as well
            logger.warning("KV pull: the default kv_port %d is taken; serving on a free port instead", port)
            return BlockServer(host, 0, **serve)

    def _share_ports(self, port: int) -> list[int]:
        """Every rank's side-channel port (the driver's handshake reports them all)."""
        if self.tp_all_reduce is None:
            return [port]
        ports = torch.zeros(self.tp_size, dtype=torch.int64, device=self._device)
        ports[self.tp_rank] = port
        return [int(p) for p in self.tp_all_reduce(ports).tolist()]

    def get_handshake_metadata(self) -> dict | None:
        if self._server is None:
            return None
        host = self.transfer.kv_ip
        if host in _WILDCARD_HOSTS:
            host = socket.gethostbyname(socket.gethostname())
        return {"host": host, "port": self._rank_ports[0], "ports": self._rank_ports, "engine_id": self.engine_id}

    def start_load_kv(self, forward_context: Any = None) -> None:
        meta, tp = self._metadata, self.tp_all_reduce is not None
        for req_id, ids in meta.send.items():
            self._served.add(req_id, ids)
            if tp:
                self._send_keys.take(req_id)
        for spec in meta.recv:
            if tp and spec.local_block_ids:
                self._recv_keys.take(spec.req_id)
            self._jobs.start(spec)
        for req_id in meta.cancel:
            self._jobs.cancel(req_id)
        for spec, failed in self._jobs.collect():
            self._recv_ended[spec.req_id] = (spec, failed)
        self._send_ended |= self._served.finished()
        self._agree()

    def _agree(self) -> None:
        """Report the transfers that ended on every rank; a load that failed on any rank failed on all (every rank's
        heads are needed for any rank's output)."""
        recv, send = self._recv_ended, self._send_ended
        if self.tp_all_reduce is None:
            done_recv, failed, done_send = set(recv), {r for r, (_, bad) in recv.items() if bad}, set(send)
        else:
            marks = torch.zeros(3, self._recv_keys.size, dtype=torch.int32, device=self._device)
            for req_id, (_, bad) in recv.items():
                marks[0, self._recv_keys[req_id]] = 1
                marks[1, self._recv_keys[req_id]] = int(bad)
            for req_id in send:
                marks[2, self._send_keys[req_id]] = 1
            marks = self.tp_all_reduce(marks).cpu()
            done_recv = {r for r in recv if marks[0, self._recv_keys[r]] == self.tp_size}
            failed = {r for r in done_recv if marks[1, self._recv_keys[r]] > 0}
            done_send = {r for r in send if marks[2, self._send_keys[r]] == self.tp_size}
            for r in done_recv:
                self._recv_keys.release(r)
            for r in done_send:
                self._send_keys.release(r)
        self._errors = {b for r in failed for b in recv[r][0].local_block_ids}
        for r in done_recv:
            del recv[r]
        send -= done_send
        self._recv_done, self._send_done = done_recv, done_send

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._errors)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._send_done, self._recv_done
        self._send_done, self._recv_done = set(), set()
        return sending or None, recving or None

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def transfer_stats(self) -> dict:
        """Worker side: the pulls completed so far, their payload bytes and seconds (for `kvserve bench`)."""
        jobs = self._jobs
        return {"num_pulled": jobs.num_pulled, "bytes": jobs.num_bytes, "seconds": jobs.seconds}
