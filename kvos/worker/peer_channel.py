"""Block rows pulled from another engine's device over a point-to-point channel: ``torch.distributed``
send/recv, NCCL between GPUs (on one host or between hosts), gloo on the CPU. The hand-over of
disaggregated prefill where CUDA IPC cannot reach: engines on different hosts, or Ray actors that
each see only their own GPUs.

Protocol, one channel per (sending process, receiving process), made on first use:

- the sender gathers rows on its device and holds them under a ticket (``PeerOutbox.hold``); it
  serves them from a ``TCPStore`` of its own (``PeerOutbox.address``);
- a receiver connects to that store and announces itself (``hello/<k>`` = its channel id); both
  then make a two-rank process group over the store (the sender is rank 0);
- per transfer the receiver writes ``<id>/want/<k>`` = the ticket and receives a header (the
  number of rows; 0 when the ticket is unknown or expired) then the rows. The sender serves a
  channel's wants in order, one at a time, and a receiver asks on a channel one transfer at a
  time, so sends and receives pair up without tags (NCCL has none).

Safety: held rows are the sender's own copies (a gather), so the blocks they came from may be
freed or rewritten at once; rows nobody asks for within ``PeerOutbox.TTL_S`` are dropped at the
next ``hold``. Tickets are random 62-bit numbers: a process that reaches the store but was not
given a ticket (through the front end) cannot guess one. The store and NCCL's sockets are not
authenticated otherwise: run engines on a trusted network, as for NCCL itself.
"""
from __future__ import annotations

import datetime
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("kvos.worker")

CHANNEL_TIMEOUT_S = 120.0
"""How long one send or receive of a channel may take before the channel is given up."""
_IDLE = datetime.timedelta(hours=1)
"""A sender's wait for the next announcement or want, renewed when it runs out (longer waits
overflow the store's millisecond counters)."""


@dataclass
class PeerRows:
    """Rows ``[rows, part_bytes]`` per part held by a sender for a receiver that pulls them:
    part r (rank r's K/V heads of a tensor-parallel sender; one part otherwise) is ticket
    ``tickets[r]`` of the store at ``addresses[r]``. Plain data: it travels through the front end."""

    addresses: list[str]
    tickets: list[int]
    rows: int
    part_bytes: int
    received: torch.Tensor | None = None
    """Set by a receiver of one part that pulled it ahead (``PeerInbox.receive``'s tensor)."""

    @property
    def nbytes(self) -> int:
        return self.rows * self.part_bytes * len(self.tickets)

    def open(self) -> PeerRows:
        return self


def reachable_host() -> str:
    """The address other hosts reach this one at: ``KVOS_P2P_HOST``, else the interface of the
    default route, else the loopback (one host)."""
    host = os.environ.get("KVOS_P2P_HOST")
    if host:
        return host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _group(store, rank: int, device: torch.device):
    """A two-rank process group over ``store``, outside the default group (which a
    tensor-parallel engine's ranks use)."""
    timeout = datetime.timedelta(seconds=CHANNEL_TIMEOUT_S)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def _wait(store, key: str) -> None:
    while True:
        try:
            store.wait([key], _IDLE)
            return
        except dist.DistStoreError:
            continue


class PeerOutbox:
    """A process's held rows and the channels that serve them (one thread per channel)."""

    TTL_S = 60.0

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._held: dict[int, tuple[torch.Tensor, float]] = {}
        self._store = None
        self.address = ""
        self.sent_bytes = 0

    def hold(self, rows: torch.Tensor) -> int:
        """Keep ``rows`` (complete: the caller synchronised their gather) for one receiver; the ticket."""
        with self._lock:
            if self._store is None:
                host = reachable_host()
                self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_IDLE)
                self.address = f"{host}:{self._store.port}"
                threading.Thread(target=self._accept, name="kvos-p2p-accept", daemon=True).start()
            now = time.monotonic()
            for t in [t for t, (_, since) in self._held.items() if now - since > self.TTL_S]:
                del self._held[t]
            ticket = secrets.randbits(62) or 1
            self._held[ticket] = (rows, now)
            return ticket

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _take(self, ticket: int) -> torch.Tensor | None:
        with self._lock:
            got = self._held.pop(ticket, None)
        return None if got is None else got[0]

    def _client(self):
        """A connection of this thread's own to the store (a blocking wait holds its connection)."""
        return dist.TCPStore("127.0.0.1", self._store.port, is_master=False,
                             timeout=datetime.timedelta(seconds=CHANNEL_TIMEOUT_S))

    def _accept(self) -> None:
        store = self._client()
        k = 0
        while True:
            k += 1
            _wait(store, f"hello/{k}")
            uid = store.get(f"hello/{k}").decode()
            threading.Thread(target=self._serve, args=(uid,), name=f"kvos-p2p-send-{k}", daemon=True).start()

    def _serve(self, uid: str) -> None:
        store = self._client()
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            group = _group(dist.PrefixStore(uid, store), 0, self.device)
            k = 0
            while True:
                k += 1
                _wait(store, f"{uid}/want/{k}")
                rows = self._take(int(store.get(f"{uid}/want/{k}")))
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    n = 0 if rows is None else rows.shape[0]
                    group.send([torch.tensor([n], dtype=torch.int64, device=self.device)], 1, 0).wait()
                    if rows is not None:
                        group.send([rows], 1, 0).wait()
                    if stream is not None:
                        stream.synchronize()
                if rows is not None:
                    self.sent_bytes += rows.numel()
        except Exception as err:  # the receiver is gone: its channel ends; others go on
            log.info("p2p channel %s closed: %s", uid, err)


@dataclass
class _Channel:
    store: object
    group: object
    uid: str
    lock: threading.Lock
    stream: object
    """The channel's own CUDA stream (None on the CPU): its receives run beside the steps."""
    wants: int = 0
    """Transfers asked for so far (the first also makes NCCL's communicator)."""


class PeerInbox:
    """A process's channels to senders, by address; ``receive`` pulls one part."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._channels: dict[str, _Channel] = {}
        self.received_bytes = 0
        self.received_s = 0.0
        """Bytes and wall time of every pull (the sender's answer included)."""
        self.setup_bytes = 0
        self.setup_s = 0.0
        """Of those, each channel's first pull, which also makes the channel and NCCL's
        communicator: the link's rate is the rest's."""

    def _channel(self, address: str) -> _Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                host, port = address.rsplit(":", 1)
                store = dist.TCPStore(host, int(port), is_master=False,
                                      timeout=datetime.timedelta(seconds=CHANNEL_TIMEOUT_S))
                uid = uuid.uuid4().hex
                store.set(f"hello/{store.add('hello', 1)}", uid)
                stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
                ch = _Channel(store, _group(dist.PrefixStore(uid, store), 1, self.device), uid, threading.Lock(), stream)
                self._channels[address] = ch
            return ch

    def receive(self, rows: PeerRows, part: int = 0) -> torch.Tensor | None:
        """Part ``part`` of ``rows`` as a new ``uint8 [rows, part_bytes]`` tensor on this device,
        complete on return; None if the sender no longer holds it. Raises if the channel fails (it
        is dropped; the next call makes a new one). On a GPU the tensor is allocated on the
        channel's stream: a caller that uses it on another stream calls ``record_stream`` so its
        memory is not reused before that use has run."""
        address = rows.addresses[part]
        ch = self._channel(address)
        t0 = time.perf_counter()
        stream = ch.stream
        try:
            with ch.lock, (torch.cuda.stream(stream) if stream is not None else nullcontext()):
                ch.wants += 1
                ch.store.set(f"{ch.uid}/want/{ch.wants}", str(rows.tickets[part]))
                header = torch.zeros(1, dtype=torch.int64, device=self.device)
                ch.group.recv([header], 0, 0).wait()
                n = int(header.item())
                if n == 0:
                    return None
                if n != rows.rows:
                    raise RuntimeError(f"p2p: {n} rows arrived for a ticket of {rows.rows}")
                out = torch.empty((n, rows.part_bytes), dtype=torch.uint8, device=self.device)
                ch.group.recv([out], 0, 0).wait()
                if stream is not None:
                    stream.synchronize()
        except Exception:
            with self._lock:
                if self._channels.get(address) is ch:
                    del self._channels[address]
            raise
        took = time.perf_counter() - t0
        self.received_bytes += out.numel()
        self.received_s += took
        if ch.wants == 1:
            self.setup_bytes += out.numel()
            self.setup_s += took
        return out


_outboxes: dict[str, PeerOutbox] = {}
_inboxes: dict[str, PeerInbox] = {}
_boxes_lock = threading.Lock()


def outbox(device: torch.device) -> PeerOutbox:
    """This process's outbox for ``device`` (made on first use)."""
    with _boxes_lock:
        if str(device) not in _outboxes:
            _outboxes[str(device)] = PeerOutbox(device)
        return _outboxes[str(device)]


def inbox(device: torch.device) -> PeerInbox:
    """This process's inbox for ``device`` (made on first use)."""
    with _boxes_lock:
        if str(device) not in _inboxes:
            _inboxes[str(device)] = PeerInbox(device)
        return _inboxes[str(device)]
