"""The two processes of the peer-copy probes: a producer that sees the host's second GPU as its
own (``CUDA_VISIBLE_DEVICES=1,0``) and shares buffers by CUDA IPC, and a consumer on the first
GPU that opens them. Both talk over two queues: ``producer(to_consumer, to_producer)``,
``consumer(from_producer, to_producer)``."""
import multiprocessing as mp
import os
import sys


def as_producer() -> None:
    """Call first in the producer, before torch initialises CUDA."""
    os.environ["CUDA_VISIBLE_DEVICES"] = "1,0"


def as_consumer() -> None:
    """Call first in the consumer, before torch initialises CUDA; kvos imports from the cwd."""
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    sys.path.insert(0, os.getcwd())


def open_shared(handles: list) -> list:
    """The producer's ``reduce_tensor`` results as tensors of this process."""
    return [rebuild(*args) for rebuild, args in handles]


def run_pair(producer, consumer, timeout_s: float = 300) -> None:
    ctx = mp.get_context("spawn")
    a, b = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=producer, args=(a, b))
    p.start()
    c = ctx.Process(target=consumer, args=(a, b))
    c.start()
    c.join(timeout_s)
    p.join(30)
