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
Tensor parallelism is refused for now (each rank would pull its own heads from its twin rank).
"""
from __future__ import annotations

import logging
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.config.engine import EngineConfig
from kvserve.config.kv_transfer import KVTransferConfig
from kvserve.core_types import KVConnectorOutput, SchedulerOutput
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvserve.kv_transfer.connectors.pull_transport import BlockServer
from kvserve.kv_transfer.connectors.pull_worker import PullJobs, PullSpec, ServedBlocks
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
        self.engine_id = self.transfer.engine_id or f"kvserve-{uuid.uuid4().hex[:12]}"
        if self.transfer.kv_connector == "NixlConnector" and role == KVConnectorRole.WORKER:
            logger.info("NixlConnector: kvserve moves the KV over TCP (its PullConnector), not NIXL")
        # scheduler side
        self.side_channel: tuple[str, int] | None = None
        """(host, port) the worker serves blocks on, from its handshake metadata (prefill side)."""
        self._pending: dict[str, _Remote] = {}
        self._pulled: set[str] = set()  # requests whose remote KV was asked for: never twice
        self._inflight: set[str] = set()
        self._meta = PullMetadata()
        # worker side
        self._served = ServedBlocks(self.lease_s)
        self._jobs = PullJobs(self.timeout_s)
        self._server: BlockServer | None = None
        self._recv_done: set[str] = set()
        self._errors: set[int] = set()

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        extra = check_extra_keys(config.kv_transfer, _KEYS)
        for key in ("lease_s", "timeout_s"):
            _seconds(extra, key, DEFAULT_LEASE_S)
        if config.parallel.tensor_parallel_size > 1:
            raise ValueError(f"kv_transfer_config: {config.kv_transfer.kv_connector} does not support "
                             "tensor_parallel_size > 1 yet (each rank would pull its own heads); use "
                             "SharedStorageConnector with tensor parallelism")

    # ---- scheduler side ----------------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict | None) -> None:
        if metadata:
            self.side_channel = (metadata["host"], metadata["port"])
            self.engine_id = metadata.get("engine_id", self.engine_id)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if (not self.transfer.is_kv_consumer or not params or not params.get("do_remote_prefill")
                or request.request_id in self._pulled):
            return 0, False
        remote = self._remote_of(request, params, num_computed_tokens // self.block_size)
        if remote is None:
            return 0, False
        num = min(len(remote.block_ids) * self.block_size, request.num_prompt_tokens - 1) - num_computed_tokens
        if num <= 0 or request.skip_reading_prefix_cache:  # nothing to read: the prefill instance may free them
            self._pulled.add(request.request_id)
            self._meta.recv.append(PullSpec(request.request_id, [], [], remote.host, remote.port, remote.request_id))
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
        remote_id = str(params.get("remote_request_id") or request.request_id)
        return _Remote(ids, host, port, remote_id, first_block)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        remote = self._pending.pop(request.request_id, None)
        if remote is None or not num_external_tokens:
            return
        first = remote.first_block
        last = -(-(first * self.block_size + num_external_tokens) // self.block_size)
        self._meta.recv.append(PullSpec(request.request_id, block_ids[first:last], remote.block_ids[first:last],
                                        remote.host, remote.port, remote.request_id))
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
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": ids,
                      "remote_engine_id": self.engine_id, "remote_host": host, "remote_port": port,
                      "remote_request_id": req_id, "tp_size": self.tp_size}

    # ---- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list) -> None:
        self._served.kv_caches = kv_caches
        self._jobs.kv_caches = kv_caches
        if self.transfer.is_kv_producer and self._server is None:
            self._server = self._listen()
            logger.info("KV pull: serving KV blocks on %s:%d (TCP)", self._server.host, self._server.port)

    def _listen(self) -> BlockServer:
        host, port = self.transfer.kv_ip, self.transfer.kv_port
        serve = dict(snapshot=self._served.snapshot, notified=self._served.notified, wait_s=min(self.timeout_s, 30.0))
        try:
            return BlockServer(host, port, **serve)
        except ValueError:
            if port != KVTransferConfig.kv_port:
                raise
            # NOTE: several producers on one host that all left kv_port at its default: the port is only ever
            # read from kv_transfer_params, so any free one serves as well
            logger.warning("KV pull: the default kv_port %d is taken; serving on a free port instead", port)
            return BlockServer(host, 0, **serve)

    def get_handshake_metadata(self) -> dict | None:
        if self._server is None:
            return None
        host = self.transfer.kv_ip
        if host in _WILDCARD_HOSTS:
            host = socket.gethostbyname(socket.gethostname())
        return {"host": host, "port": self._server.port, "engine_id": self.engine_id}

    def start_load_kv(self, forward_context: Any = None) -> None:
        meta = self._metadata
        for req_id, ids in meta.send.items():
            self._served.add(req_id, ids)
        for spec in meta.recv:
            self._jobs.start(spec)
        for req_id in meta.cancel:
            self._jobs.cancel(req_id)
        self._recv_done, self._errors = self._jobs.collect()

    def transfer_stats(self) -> dict:
        """Worker side: the pulls completed so far, their payload bytes and seconds (for `kvserve bench`)."""
        jobs = self._jobs
        return {"num_pulled": jobs.num_pulled, "bytes": jobs.num_bytes, "seconds": jobs.seconds}

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._errors)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recv, self._recv_done = self._recv_done, set()
        return self._served.finished() or None, recv or None

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
