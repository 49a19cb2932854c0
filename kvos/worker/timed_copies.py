"""Device-to-device copies on a side stream, each timed on the device by the copy alone."""
from __future__ import annotations

import ctypes
import threading

import torch


def _driver() -> ctypes.PyDLL | None:
    """The CUDA driver library, called with the GIL held (``PyDLL``), or None without one."""
    try:
        lib = ctypes.PyDLL("libcuda.so.1")
    except OSError:
        return None
    lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    return lib


class TimedCopies:
    """Copies of contiguous device memory queued on a side stream of ``device``, so that they
    run beside the steps queued on the current stream instead of after them.

    Each copy is queued between two timing events with three driver calls made without
    releasing the GIL (torch's ops release it, and another thread of the engine process that
    takes it can delay the next call by a switch interval), behind a spin of about 50 µs on the
    side stream (``LEAD_CYCLES``), so that all three are queued before the device reaches the
    first event. The events then hold the copy alone, not the host's time to queue it, and
    ``seconds`` is the device's time for the copies. The spin delays each copy by that much.

    Safety: ``src`` must be readable from ``device`` (its own memory, a peer GPU's with peer
    access, or CUDA IPC memory opened on it) and complete before ``copy`` is called: the side
    stream waits for nothing. Work the caller queues afterwards on its current stream waits for
    the copy. ``copy`` keeps ``src`` referenced until the copy has run (``collect``).
    """

    SIZE_CLASSES = (0, 4, 16, 64, 256)
    KEEP_RATES = 100_000
    LEAD_CYCLES = 100_000
    """GPU clock cycles the side stream spins before each copy's first event."""
    WARM_BYTES = 1 << 20
    """What ``warm`` reads: enough to wake a peer link that has slept since its last copy, so the copy
    after it runs at the link's rate (``benchmarks/scripts/peer_copy_idle_causes.py``; figures on the
    routing benchmark page)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._lib = _driver()
        self._idle: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._running: list[tuple[torch.cuda.Event, torch.cuda.Event, torch.Tensor]] = []
        self.copies = 0
        self.bytes = 0
        self.seconds = 0.0
        """The collected copies: how many, their bytes, and their device time (between each
        one's two events)."""
        self.by_size: dict[str, list] = {}
        """The same three figures per size class (``SIZE_CLASSES``: at least that many MiB)."""
        self.rates: dict[str, list[float]] = {}
        """Each collected copy's GB/s, per size class (the first ``KEEP_RATES`` of each)."""
        self._warm_lock = threading.Lock()
        self._warming: list[tuple[torch.cuda.Event, torch.cuda.Event, torch.Tensor, int]] = []
        self._warm_dst: torch.Tensor | None = None
        self.warm_copies = 0
        self.warm_bytes = 0
        self.warm_seconds = 0.0
        """The collected ``warm`` reads, timed on the device like the copies but counted apart."""

    def warm(self, src: torch.Tensor) -> None:
        """Any thread: queue a read of ``src``'s first ``WARM_BYTES`` on the side stream now (timed
        like a copy), so that a ``copy`` queued later finds the peer link awake. Same safety rule
        as ``copy`` (``src`` complete and readable from ``device``); ``src`` stays referenced
        until the read has run (``collect``). The read comes before any later copy on the stream."""
        flat = src.reshape(-1).view(torch.uint8)
        n = min(self.WARM_BYTES, flat.numel())
        with torch.cuda.device(self.device), self._warm_lock:
            if self._warm_dst is None:
                self._warm_dst = torch.empty(self.WARM_BYTES, dtype=torch.uint8, device=self.device)
            start, end = self._new_events()
            self._queue(self._warm_dst[:n], flat[:n], n, start, end)
            self._warming.append((start, end, src, n))

    def copy(self, src: torch.Tensor) -> torch.Tensor:
        """A copy of ``src`` (contiguous) in new memory of ``device``; the caller's current stream
        waits for it."""
        if not src.is_contiguous():
            raise ValueError("TimedCopies.copy needs a contiguous source")
        main = torch.cuda.current_stream(self.device)
        start, end = self._events()
        nbytes = src.numel() * src.element_size()
        with torch.cuda.stream(self.stream):
            dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        self._queue(dst, src, nbytes, start, end)
        main.wait_event(end)
        dst.record_stream(main)
        self._running.append((start, end, src))
        return dst

    def _queue(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, start: torch.cuda.Event,
               end: torch.cuda.Event) -> None:
        """Spin, ``start``, the copy, ``end`` on the side stream (the class docstring's rule)."""
        lib = self._lib
        if lib is not None:
            s, e0, e1 = (ctypes.c_void_p(h) for h in (self.stream.cuda_stream, start.cuda_event, end.cuda_event))
            to, frm = dst.data_ptr(), src.data_ptr()
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(self.LEAD_CYCLES)
            if lib.cuEventRecord(e0, s) or lib.cuMemcpyAsync(to, frm, nbytes, s) or lib.cuEventRecord(e1, s):
                raise RuntimeError("CUDA driver call failed queuing a timed copy")
        else:
            with torch.cuda.stream(self.stream):
                start.record()
                dst.copy_(src)
                end.record()

    def _events(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Stepping thread (``copy``'s) only: a pair from the ones ``collect`` gave back."""
        return self._idle.pop() if self._idle else self._new_events()

    def _new_events(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for e in pair:  # torch creates an event at its first record
            e.record(self.stream)
        return pair

    @property
    def busy(self) -> bool:
        return bool(self._running) or bool(self._warming)

    def collect(self) -> None:
        """Account and release the copies and warm reads that have run (in queue order)."""
        with self._warm_lock:
            while self._warming and self._warming[0][1].query():
                start, end, _, n = self._warming.pop(0)
                self.warm_copies += 1
                self.warm_bytes += n
                self.warm_seconds += start.elapsed_time(end) / 1000
        while self._running and self._running[0][1].query():
            start, end, src = self._running.pop(0)
            nbytes, seconds = src.numel() * src.element_size(), start.elapsed_time(end) / 1000
            self.copies += 1
            self.bytes += nbytes
            self.seconds += seconds
            mib = max(c for c in self.SIZE_CLASSES if nbytes >= c << 20)
            row = self.by_size.setdefault(f">={mib}MiB", [0, 0, 0.0])
            row[0] += 1
            row[1] += nbytes
            row[2] += seconds
            rates = self.rates.setdefault(f">={mib}MiB", [])
            if len(rates) < self.KEEP_RATES:
                rates.append(nbytes / 1e9 / seconds if seconds > 0 else float("inf"))
            self._idle.append((start, end))
