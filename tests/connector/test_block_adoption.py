"""Blocks one engine computed, adopted into another engine's pool (the decode side of
disaggregated prefill on one GPU host, here with host rows on the CPU)."""
from __future__ import annotations

from kvos import SamplingParams
from kvos.cache.hashing import extend_block_hashes, root_hash

PROMPT = "The page table maps virtual pages to physical frames. " * 9 + "Summarize the paragraph."


def test_adopted_blocks_serve_as_prefix_hits_with_the_reference_output(llm, make_llm):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    ids = ref.prompt_token_ids
    src_llm = make_llm(num_blocks=64)
    src_llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    src = src_llm.engine
    hashes: list[bytes] = []
    extend_block_hashes(hashes, ids[: len(ids) - 1], src.kv.block_size, root_hash(src.kv.model_id, None))
    blocks = [src.kv.pool.lookup(h) for h in hashes]
    assert len(hashes) >= 3 and all(b is not None for b in blocks)
    rows = src.runner.read_blocks([b.block_id for b in blocks])

    dst_llm = make_llm(num_blocks=64)
    dst = dst_llm.engine
    assert dst.adopt_blocks(hashes, blocks[0].parent_hash, rows) == len(hashes)
    assert dst.adopt_blocks(hashes, blocks[0].parent_hash, rows) == 0  # already cached: skipped
    out = dst_llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens == len(hashes) * src.kv.block_size
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_adoption_takes_only_the_blocks_the_pool_can_give(llm, make_llm):
    """A pool with fewer free blocks than offered caches a leading part; the rest is computed."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    ids = ref.prompt_token_ids
    src = make_llm(num_blocks=64)
    src.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    e = src.engine
    hashes: list[bytes] = []
    extend_block_hashes(hashes, ids[: len(ids) - 1], e.kv.block_size, root_hash(e.kv.model_id, None))
    blocks = [e.kv.pool.lookup(h) for h in hashes]
    rows = e.runner.read_blocks([b.block_id for b in blocks])
    dst = make_llm(num_blocks=len(hashes) + 8)
    dst.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)  # fills the pool with its own copy
    dst.engine.reset_prefix_cache()
    pool = dst.engine.kv.pool
    held = pool.get_new_blocks(pool.num_free_blocks() - 2)  # a running request's blocks
    assert dst.engine.adopt_blocks(hashes, blocks[0].parent_hash, rows) == 2
    pool.free_blocks(reversed(held))
    out = dst.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens == 2 * e.kv.block_size
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
