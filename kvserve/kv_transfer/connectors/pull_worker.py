"""The pull connector's worker side: the blocks this instance serves (prefill) and the pulls it runs (decode).

Serving: a finished request's blocks are registered with a lease; the side channel's threads send them straight
from the cache, and a request is reported sent (read and notified, or its lease expired) only while no read of it
is in progress, so once the scheduler may hand its blocks out no read touches them again. Pulling: one background
thread per request checks the layout, reads the blocks straight into the ones the scheduler allocated for it (no
one else reads or writes those until it resumes), checks the checksum and then tells the server it is done.
A finished pull is reported at the next step's start, so that its failed blocks and its completion reach the
scheduler in the same step's output.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvserve.kv_transfer.connectors.pull_transport import TransferError, connect, notify, read_into

logger = logging.getLogger("kvserve")

_GONE_MEMORY = 4096


@dataclass(frozen=True)
class PullSpec:
    """One request's pull: its blocks at `local_block_ids` come from the prefill instance's `remote_block_ids`
    (empty lists: nothing to read, only tell the prefill instance it may free them)."""
    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_ports: tuple[int, ...] = ()
    """Each tensor-parallel rank's side channel (rank r reads its heads from rank r); empty: remote_port + r."""

    def port_for(self, rank: int) -> int:
        return self.remote_ports[rank] if rank < len(self.remote_ports) else self.remote_port + rank


@dataclass
class _Served:
    block_ids: frozenset[int]
    deadline: float
    readers: int = 0
    """Reads in progress: the blocks stay served (the lease waits) until they end."""
    read: bool = False
    """The reader said it is done."""


class ServedBlocks:
    """Requests whose blocks this (prefill) instance serves, each until its reader says it is done or its lease
    expires, and no read of it is in progress."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self.kv_caches: list = []
        self._lock = threading.Lock()
        self._served: dict[str, _Served] = {}
        self._done: set[str] = set()
        self._gone: OrderedDict[str, str] = OrderedDict()  # why a request is no longer served, for readers

    def add(self, req_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._served[req_id] = _Served(frozenset(block_ids), time.monotonic() + self.lease_s)

    def begin_read(self, req_id: str, block_ids: list[int]) -> list:
        """The caches to read the blocks from, served until end_read. KeyError: not registered yet; TransferError:
        no longer served, or not its blocks."""
        with self._lock:
            entry = self._served.get(req_id)
            if entry is None or entry.read:
                if req_id in self._gone or entry is not None:
                    raise TransferError(f"request {req_id} is no longer served here "
                                        f"({self._gone.get(req_id, 'already read')})")
                raise KeyError(f"request {req_id} is not served here (unknown request id)")
            if not entry.block_ids.issuperset(block_ids):
                raise TransferError(f"blocks {sorted(set(block_ids) - entry.block_ids)} are not request {req_id}'s")
            entry.readers += 1
            return self.kv_caches

    def end_read(self, req_id: str) -> None:
        with self._lock:
            self._served[req_id].readers -= 1

    def notified(self, req_id: str) -> None:
        with self._lock:
            entry = self._served.get(req_id)
            if entry is not None:
                entry.read = True

    def finished(self) -> set[str]:
        """Requests whose blocks are no longer read (read, or their lease expired) since the last call."""
        now = time.monotonic()
        with self._lock:
            done = []
            for req_id, entry in self._served.items():
                if entry.readers:
                    continue
                if entry.read:
                    done.append((req_id, "already read"))
                elif entry.deadline <= now:
                    done.append((req_id, f"its lease of {self.lease_s:g} s expired"))
                    logger.warning("KV pull: no decode instance read request %s's blocks within its lease (%g s); "
                                   "freeing them", req_id, self.lease_s)
            for req_id, why in done:
                del self._served[req_id]
                self._forget(req_id, why)
        return {req_id for req_id, _ in done}

    def _forget(self, req_id: str, why: str) -> None:
        self._gone[req_id] = why
        while len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)


@dataclass
class _Job:
    spec: PullSpec
    cancelled: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    done: bool = False


class PullJobs:
    """The pulls in flight on this (decode) instance, each on its own thread; `rank` reads the same rank."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.rank = 0
        self.kv_caches: list = []
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self.num_pulled = 0
        """Pulls that completed, their payload bytes and seconds (connect to notify), over the connector's life."""
        self.num_bytes = 0
        self.seconds = 0.0

    def start(self, spec: PullSpec) -> None:
        job = _Job(spec)
        if spec.local_block_ids:
            self._jobs[spec.req_id] = job
        threading.Thread(target=self._run, args=(job,), name=f"kv-pull-{spec.req_id}", daemon=True).start()

    def cancel(self, req_id: str) -> None:
        job = self._jobs.get(req_id)
        if job is not None:
            job.cancelled.set()

    def collect(self) -> list[tuple[PullSpec, bool]]:
        """The pulls that ended since the last call, each with whether it failed (a cancelled one did not)."""
        with self._lock:
            ended = [job for job in self._jobs.values() if job.done]
        for job in ended:
            del self._jobs[job.spec.req_id]
        return [(job.spec, job.error is not None and not job.cancelled.is_set()) for job in ended]

    def _run(self, job: _Job) -> None:
        spec = job.spec
        start = time.monotonic()
        try:
            num_bytes = pull_into(self.kv_caches, spec, start + self.timeout_s, job.cancelled, self.rank)
            seconds = time.monotonic() - start
            logger.debug("KV pull: request %s: %d blocks, %d bytes in %.3f s", spec.req_id,
                         len(spec.local_block_ids), num_bytes, seconds)
            with self._lock:
                self.num_pulled += bool(spec.local_block_ids)
                self.num_bytes += num_bytes
                self.seconds += seconds
        except TransferError as e:
            job.error = str(e)
            if not job.cancelled.is_set():
                logger.warning("KV pull: request %s's KV from %s:%s (its request %s) failed: %s", spec.req_id,
                               spec.remote_host, spec.remote_port, spec.remote_request_id, e)
        except Exception as e:  # a bug here must fail the request, not end the thread silently
            job.error = f"{type(e).__name__}: {e}"
            logger.exception("KV pull: request %s failed", spec.req_id)
        with self._lock:
            job.done = True


def pull_into(kv_caches: list, spec: PullSpec, deadline: float, cancelled: threading.Event, rank: int = 0) -> int:
    """Read spec's blocks from the prefill instance's rank `rank` into `kv_caches`, then tell it they were read;
    returns the payload's bytes."""
    sock = connect(spec.remote_host, spec.port_for(rank), deadline)
    try:
        if not spec.remote_block_ids:
            notify(sock, spec.remote_request_id, deadline)
            return 0
        try:
            nbytes = read_into(sock, spec.remote_request_id, spec.remote_block_ids, kv_caches, spec.local_block_ids,
                               deadline, cancelled)
        except TransferError as e:
            if e.read_whole:  # unusable, but read to its end: the prefill side may free them
                notify(sock, spec.remote_request_id, deadline)
            raise
        notify(sock, spec.remote_request_id, deadline)
        return nbytes
    finally:
        sock.close()


class SlotKeys:
    """Small integer keys for requests, the same on every tensor-parallel rank (every rank takes and releases
    them in the same order, from the same metadata and the same agreements): a request's slot in the masks the
    ranks sum to agree that it ended everywhere."""

    def __init__(self, size: int):
        self.size = size
        self._free = list(range(size - 1, -1, -1))
        self._keys: dict[str, int] = {}

    def take(self, req_id: str) -> None:
        if req_id not in self._keys:
            if not self._free:
                raise RuntimeError(f"more than {self.size} KV transfers in flight")
            self._keys[req_id] = self._free.pop()

    def __getitem__(self, req_id: str) -> int:
        return self._keys[req_id]

    def release(self, req_id: str) -> None:
        key = self._keys.pop(req_id, None)
        if key is not None:
            self._free.append(key)
            self._free.sort(reverse=True)
