"""A CPU-tier load as the engine runs it (``TierIO.fetch`` then ``install``), digested a chunk at
a time while later blocks still copy: on the CPU, and on a GPU with pinned slots, a copy stream
and a digest stream (skipped without one)."""
from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("order", ["in-order", "shuffled"])
@pytest.mark.parametrize("device", DEVICES)
def test_load_digests_in_chunks_and_stops_at_a_corrupt_block(device, order, monkeypatch):
    """40 blocks, digested 3 at a time, stored into consecutive slots (copied in runs of at most 5)
    or in a shuffled order (runs broken wherever the next block is not in the next slot): intact,
    every installed block equals the stored one; with block 25 corrupted in its slot, the load
    keeps exactly blocks 0-24 (a chunk digested before it cannot vouch for it, one after it must
    not be kept) and drops that block from the tier."""
    import kvos.connector.tier_io as tier_io_mod
    from kvos.cache.tiers import CPUTier, TierHierarchy, allocate_bytearray
    from kvos.connector.tier_io import TierIO, host_digest
    from kvos.worker.runner import ModelRunner

    n = 40
    dev = torch.device(device)
    runner = ModelRunner.__new__(ModelRunner)  # only the KV tensor: what the tier path touches
    runner.device, runner.dtype = dev, torch.bfloat16
    kv = torch.randn(2 * n + 1, 4, 2, 16, 2, 64, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
    runner.group_caches = [kv]
    runner.group_pages = [kv.view(2 * n + 1, -1).view(torch.uint8)]
    bb = runner.block_bytes
    monkeypatch.setattr(tier_io_mod, "DIGEST_PIPELINE_BYTES", 3 * bb)
    monkeypatch.setattr(tier_io_mod, "COPY_RUN_BYTES", 5 * bb + 1000)
    if dev.type == "cuda":
        from kvos.connector.host_memory import PageLockedAllocator

        allocate = PageLockedAllocator()
        torch.cuda.synchronize()
    else:
        allocate = allocate_bytearray
    cpu = CPUTier(2 * (bb + 128) * (n + 4), allocate, digest_fn=host_digest)
    tio = TierIO(TierHierarchy([cpu]), runner)
    keys = [i.to_bytes(16, "little") for i in range(1, n + 1)]
    perm = list(range(n))
    if order == "shuffled":
        perm = [perm[i] for i in torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()]
    for i in perm:  # one store per block: slots taken in this order
        tio.store_computed([keys[i]], [i + 1], None)
    expected = kv[1: n + 1].clone()
    loaded = tio.fetch(keys)
    assert loaded.sources == ["cpu"] * n
    tio.install(loaded, list(range(n + 1, 2 * n + 1)))
    assert torch.equal(kv[n + 1:].cpu(), expected.cpu())
    cpu.corrupt(keys[25])
    loaded = tio.fetch(keys)
    assert loaded.sources == ["cpu"] * 25 and not cpu.contains(keys[25])
    assert cpu.stats.checksum_failures == 1
    assert torch.equal(loaded.rows.view(torch.bfloat16).view(25, *kv.shape[1:]).cpu(), expected[:25].cpu())
    tio.close()
