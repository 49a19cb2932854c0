"""GB/s of the ``p2p`` hand-over's channel (``kvos.worker.peer_channel``) between two GPUs of one
host, against NCCL's own send/recv and a peer ``copy_`` in the same run.

A sender process on ``cuda:1`` holds ``--pulls`` rows of ``--mib`` MiB (as a prefill engine
holds a prompt's blocks); a receiver process on ``cuda:0`` pulls them one at a time
(``PeerInbox.receive``: the want, the header, the rows, complete on return). Prints JSON.

    python benchmarks/scripts/p2p_channel_gpu.py --mib 400 --pulls 20
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time


def sender(q_out, q_in, mib: int, pulls: int) -> None:
    import torch

    from kvos.worker.peer_channel import outbox

    dev = torch.device("cuda", 1)
    torch.cuda.set_device(dev)
    box = outbox(dev)
    tickets = [box.hold(torch.full((mib, 1 << 20), i % 251, dtype=torch.uint8, device=dev)) for i in range(pulls + 2)]
    torch.cuda.synchronize()
    q_out.put((box.address, tickets))
    q_in.get()  # until the receiver is done


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=400)
    p.add_argument("--pulls", type=int, default=20)
    a = p.parse_args()
    import torch

    from kvos.worker.peer_channel import PeerRows, inbox

    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=sender, args=(q_out, q_in, a.mib, a.pulls), daemon=True)
    proc.start()
    address, tickets = q_out.get(timeout=300)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    box = inbox(dev)
    times = []
    for i, t in enumerate(tickets):
        t0 = time.perf_counter()
        rows = box.receive(PeerRows([address], [t], a.mib, 1 << 20))
        times.append(time.perf_counter() - t0)
        assert rows is not None and int(rows[0, 0]) == i % 251 and int(rows[-1, -1]) == i % 251
        del rows
    q_in.put(None)
    proc.join(30)
    timed = times[2:]  # the first pulls make the channel and NCCL's communicator
    nbytes = a.mib << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize(0), torch.cuda.synchronize(1)
    t0 = time.perf_counter()
    for _ in range(8):
        dst.copy_(src)
    torch.cuda.synchronize(0), torch.cuda.synchronize(1)
    copy_gb_s = 8 * nbytes / 1e9 / (time.perf_counter() - t0)
    from kvos.bench.machine import machine_info

    print(json.dumps({"machine": machine_info(), "gpu": torch.cuda.get_device_name(0), "mib": a.mib, "pulls": len(timed),
                      "first_pull_s": times[0], "pull_ms": [round(x * 1e3, 2) for x in timed],
                      "pull_gb_s_mean": len(timed) * nbytes / 1e9 / sum(timed),
                      "pull_gb_s_best": nbytes / 1e9 / min(timed), "peer_copy_gb_s": copy_gb_s}, indent=1))


if __name__ == "__main__":
    main()
