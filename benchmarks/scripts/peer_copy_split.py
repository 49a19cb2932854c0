"""Probe: does one peer copy split across several streams (so several copy engines) move its
bytes faster than one copy? The engine's hand-overs are single copies of about 16 MiB, and
those run at about 82% of the link in a quiet process (``peer_copy_idle_gaps.py``). Prints:
- per size (4, 16, 64, 256 MiB) and per split (1, 2, 3, 4 streams), with the link awake (a copy
  0.5 ms before): the median of 20 device windows (a spin, a start event, the chunks on their
  streams, an end event after all of them), as microseconds and GB/s;
- the same at 16 MiB while the consuming GPU runs memory-bound adds on its main stream (as a
  decode engine does);
- the link as ``kvos bench fleet --peer-bandwidth`` measures it (8 x 256 MiB, host clock), with
  the copies split over 1, 2 and 4 streams;
- 16 MiB after gaps of 15 to 40 ms without peer traffic (one stream): where the link starts to
  sleep.

Run from the repo root on a host with two GPUs: python3 benchmarks/scripts/peer_copy_split.py"""
import statistics
import time

from ipc_pair import as_consumer, as_producer, open_shared, run_pair

MIB = 1 << 20
SIZES = (4, 16, 64, 256)
SPLITS = (1, 2, 3, 4)
REPS = 20


def producer(q_out, q_in):
    as_producer()
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    src = torch.randint(0, 255, (256 * MIB,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    q_out.put([reduce_tensor(src)])
    assert q_in.get() == "stop"


def consumer(q_in, q_out):
    as_consumer()
    import torch
    (src,) = open_shared(q_in.get())
    dev = src.device
    dst = torch.empty_like(src)
    streams = [torch.cuda.Stream(device=dev) for _ in range(max(SPLITS))]
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)

    def window(nbytes: int, k: int) -> float:
        """Device microseconds from the start event to the end of the last chunk."""
        s0 = streams[0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event() for _ in range(k)]
        chunk = -(-nbytes // k)
        with torch.cuda.stream(s0):
            torch.cuda._sleep(200_000)
            start.record()
        for i in range(k):
            s = streams[i]
            if i:
                s.wait_event(start)
            with torch.cuda.stream(s):
                a, b = i * chunk, min(nbytes, (i + 1) * chunk)
                dst[a:b].copy_(src[a:b])
                ends[i].record()
        for e in ends[1:]:
            s0.wait_event(e)
        with torch.cuda.stream(s0):
            end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000

    def show(label: str, nbytes: int, times: list[float]) -> None:
        med = statistics.median(times)
        print(f"{label:34s}: min {min(times):8.1f} med {med:8.1f} max {max(times):8.1f} us; "
              f"{nbytes / med / 1e3:6.1f} GB/s median", flush=True)

    for _ in range(5):
        for k in SPLITS:
            window(256 * MIB, k)
    for mib in SIZES:
        for k in SPLITS:
            times = []
            for _ in range(REPS):
                time.sleep(0.0005)
                times.append(window(mib * MIB, k))
            show(f"{mib:3d} MiB, {k} stream(s)", mib * MIB, times)
    for k in (1, 2):
        times = []
        for _ in range(REPS):
            big.add_(1)  # ~0.5 ms of memory-bound work on the main stream, under way when the copy runs
            times.append(window(16 * MIB, k))
        torch.cuda.synchronize()
        show(f" 16 MiB, {k} stream(s), consumer busy", 16 * MIB, times)
    for k in (1, 2, 4):
        rates = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(8):
                for i in range(k):
                    a, b = i * (256 * MIB // k), (i + 1) * (256 * MIB // k)
                    with torch.cuda.stream(streams[i]):
                        dst[a:b].copy_(src[a:b])
            torch.cuda.synchronize()
            rates.append(8 * 256 * MIB / (time.perf_counter() - t0) / 1e9)
        print(f"link, 8 x 256 MiB host clock, {k} stream(s): {statistics.median(rates):6.1f} GB/s median "
              f"(max {max(rates):6.1f})", flush=True)
    for gap_ms in (15, 20, 30, 40):
        times = []
        for _ in range(10):
            time.sleep(gap_ms / 1000)
            times.append(window(16 * MIB, 1))
        show(f" 16 MiB after {gap_ms} ms idle", 16 * MIB, times)
    q_out.put("stop")


if __name__ == "__main__":
    run_pair(producer, consumer)
