"""KV events from a real engine (the default model): a subscriber that applies the batches holds
exactly the engine's prefix index, through hits, evictions under pressure and a reset; batches
are plain values that cross a process boundary (pickle); a missed batch is noticed and a
snapshot repairs it."""
from __future__ import annotations

import pickle

import pytest

from kvos import SamplingParams
from kvos.core.kv_events import AllCleared, BlockRemoved, BlockStored, CachedBlockSet


@pytest.fixture(scope="module")
def engine(make_llm):
    llm = make_llm(kv_events=True, num_blocks=12, block_size=16)
    yield llm.engine
    del llm


def index_hashes(engine) -> set[bytes]:
    return set(engine.kv.pool.index.hashes())


def test_subscriber_mirrors_the_prefix_index(engine):
    view = CachedBlockSet()
    params = SamplingParams(temperature=0, max_tokens=4)
    system = "You are a helpful assistant who answers in one short sentence. " * 2
    llm_generate = engine_generate(engine)
    stored = removed = 0
    seq = 0
    for question in ["What is 2+2?", "Name a colour of the rainbow, please.", "Capital of France?",
                     "Which prime numbers are smaller than twenty?", "Largest planet?", "Boiling point of water?"]:
        llm_generate(system + question * 8, params)
        batch = engine.drain_kv_events()
        if batch is None:  # nothing stored or evicted: the view is still exact
            assert view.groups[0] == index_hashes(engine)
            continue
        batch = pickle.loads(pickle.dumps(batch))  # as a router in another process gets it
        seq += 1
        assert batch.seq == seq and view.apply(batch)
        assert view.groups[0] == index_hashes(engine)
        stored += sum(isinstance(e, BlockStored) for e in batch.events)
        removed += sum(isinstance(e, BlockRemoved) for e in batch.events)
        assert all(e.num_tokens == 16 for e in batch.events if isinstance(e, BlockStored))
    assert seq >= 4
    assert removed > 0  # 11 usable blocks cannot hold every prompt: evictions were published
    assert stored - removed == len(index_hashes(engine))
    # the shared system prompt's blocks were hit, not stored again: a router scores them
    hashes = engine.kv.block_hashes(engine_request(engine, system + "Anything?"))
    assert view.prefix_hits(hashes) >= len(engine.tokenizer.encode(system)) // 16 - 1


def test_missed_batch_is_noticed_and_a_snapshot_repairs_it(engine):
    view = CachedBlockSet()
    view.reset(engine.kv_event_snapshot())
    assert view.groups[0] == index_hashes(engine)
    params = SamplingParams(temperature=0, max_tokens=2)
    engine_generate(engine)("A sentence about the sea and the sky, " * 3, params)
    engine.drain_kv_events()  # lost on the way
    engine_generate(engine)("Another sentence, about mountains and rivers, " * 3, params)
    assert not view.apply(engine.drain_kv_events())
    view.reset(engine.kv_event_snapshot())
    assert view.groups[0] == index_hashes(engine)
    engine.reset_prefix_cache()
    batch = engine.drain_kv_events()
    assert batch.events == (AllCleared(),)
    assert view.apply(batch) and view.groups[0] == set() == index_hashes(engine)


def test_undrained_events_stay_bounded_and_show_a_gap():
    from kvos.cache.events import KVEventLog

    log, view = KVEventLog(), CachedBlockSet()
    log.MAX_PENDING = 4
    log.stored(b"a", b"root", 16, 0)
    assert view.apply(log.drain())
    for i in range(10):
        log.stored(bytes([i]), b"a", 16, 0)
    assert len(log._pending) <= 4
    assert not view.apply(log.drain())  # events were dropped: the subscriber must resync


def test_events_off_by_default(llm):
    with pytest.raises(RuntimeError, match="kv_events"):
        llm.engine.drain_kv_events()


def engine_request(engine, text: str):
    from kvos.core.request import Request

    return Request("probe", engine.tokenizer.encode(text), SamplingParams(max_tokens=1))


def engine_generate(engine):
    def run(text: str, params: SamplingParams) -> None:
        engine.add_request(engine.tokenizer.encode(text), params)
        while engine.has_unfinished_requests():
            engine.step()
    return run


def test_a_hybrid_engines_first_batch_applies_before_any_snapshot():
    """A router's set starts with one group; a hybrid engine's first batch (seq 1, nothing missed)
    stores blocks of its other groups too (this raised IndexError and ended the front end's poll
    loop for that engine, so its requests never finished)."""
    from kvos.core.kv_events import KVEventBatch

    s = CachedBlockSet()
    batch = KVEventBatch("e", "epoch", 1, (BlockStored(b"a", b"root", 4, group=0), BlockStored(b"b", b"root", 4, group=2),
                                           BlockRemoved(b"c", group=3)))
    assert s.apply(batch)
    assert s.prefix_hits([b"a"]) == 1 and s.prefix_hits([b"b"], group=2) == 1 and s.prefix_hits([b"b"], group=1) == 0
