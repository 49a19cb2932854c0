"""The point-to-point channel of disaggregated prefill's ``p2p`` hand-over, on the CPU (gloo):
rows held under tickets are pulled whole, in any order, by several receivers; a ticket pulled
once, never held, or past its time gives nothing."""
from __future__ import annotations

import threading

import torch

from kvos.worker import peer_channel
from kvos.worker.peer_channel import PeerInbox, PeerOutbox, PeerRows

CPU = torch.device("cpu")


def rows_of(seed: int, n: int = 5, width: int = 48) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=g)


def test_tickets_are_pulled_whole_in_any_order_once():
    out = PeerOutbox(CPU)
    a, b = rows_of(1), rows_of(2, n=3, width=16)
    ta, tb = out.hold(a.clone()), out.hold(b.clone())
    inbox = PeerInbox(CPU)
    got_b = inbox.receive(PeerRows([out.address], [tb], 3, 16))
    got_a = inbox.receive(PeerRows([out.address], [ta], 5, 48))
    assert torch.equal(got_a, a) and torch.equal(got_b, b)
    assert inbox.receive(PeerRows([out.address], [ta], 5, 48)) is None  # already taken
    assert inbox.receive(PeerRows([out.address], [999], 5, 48)) is None  # never held
    assert out.held == 0 and out.sent_bytes == a.numel() + b.numel() == inbox.received_bytes


def test_receivers_on_their_own_channels_at_once():
    """Two receivers (two channels to one sender) pulling side by side each get their own rows."""
    out = PeerOutbox(CPU)
    want = {i: rows_of(10 + i) for i in range(6)}
    tickets = {i: out.hold(r.clone()) for i, r in want.items()}
    got: dict[int, torch.Tensor] = {}

    def pull(ids) -> None:
        inbox = PeerInbox(CPU)
        for i in ids:
            got[i] = inbox.receive(PeerRows([out.address], [tickets[i]], 5, 48))

    threads = [threading.Thread(target=pull, args=(ids,)) for ids in ([0, 2, 4], [5, 3, 1])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == list(range(6)) and all(torch.equal(got[i], want[i]) for i in want)


def test_rows_nobody_pulls_expire(monkeypatch):
    out = PeerOutbox(CPU)
    monkeypatch.setattr(PeerOutbox, "TTL_S", 0.0)
    old = out.hold(rows_of(3))
    out.hold(rows_of(4))  # a later hold drops what outlived the TTL
    assert out.held == 1
    assert PeerInbox(CPU).receive(PeerRows([out.address], [old], 5, 48)) is None


def test_one_outbox_and_inbox_per_device():
    assert peer_channel.outbox(CPU) is peer_channel.outbox(CPU)
    assert peer_channel.inbox(CPU) is peer_channel.inbox(CPU)
