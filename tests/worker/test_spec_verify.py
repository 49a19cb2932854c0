"""Rejection sampling of speculative drafts keeps the target's distribution: chi-square against
the float64 reference of the sampler's filtered softmax (``reference``), for the first token and
for the token after an accepted draft, with a point-mass proposer (n-gram) that proposes well or
badly and with a proposer that has its own distribution. Greedy verification is exact; seeded
verification does not depend on the batch. On the CPU, and on a GPU when there is one."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvos.core.sampling_params import SamplingParams
from kvos.worker.spec_verify import DraftRows, filtered_probs, launch_verify
from tests.worker.test_sampler_distribution import DEVICES, chi2_critical, reference

pytestmark = pytest.mark.gpu

V = 40
PARAMS = SamplingParams(temperature=0.9, top_k=25, top_p=0.9, min_p=0.02)


def chi2(counts: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    n = counts.sum()
    kept = p > 0
    assert counts[~kept].sum() == 0, "a token outside the kept set was drawn"
    exp = n * p[kept]
    stat = float(((counts[kept] - exp) ** 2 / exp).sum())
    return stat, chi2_critical(int(kept.sum()) - 1)


def verify_many(logits: torch.Tensor, drafts: list[int], params: SamplingParams, n: int,
                q: torch.Tensor | None = None) -> list[list[int]]:
    """``n`` independent verifications of ``drafts`` against the same ``len(drafts) + 1`` logits rows."""
    k = len(drafts)
    batch = logits.repeat(n, 1)
    entries = [DraftRows(f"r{i}", i * (k + 1), drafts, params, None, q) for i in range(n)]
    got = launch_verify(batch, entries).collect()
    return [got[f"r{i}"] for i in range(n)]


def logits_for(seed: int, rows: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, V, generator=g) * 2.0).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("proposer", ["likely", "unlikely", "outside", "own_distribution"])
def test_first_and_second_tokens_follow_the_target(device, proposer):
    torch.manual_seed(1)
    logits = logits_for(7, 3, device)
    p = [reference(logits[i].cpu().numpy(), PARAMS.temperature, PARAMS.top_k, PARAMS.top_p, PARAMS.min_p)
         for i in range(3)]
    order = np.argsort(-p[0])
    q = None
    if proposer == "likely":
        d1 = int(order[0])
    elif proposer == "unlikely":
        d1 = int(order[int((p[0] > 0).sum()) - 1])  # the least likely kept token
    elif proposer == "outside":
        d1 = int(order[-1])  # a token the target never samples: always rejected
    else:  # a proposer with a distribution of its own, far from the target's
        qd = torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(3)) * 3, dim=-1)
        d1 = int(qd[0].argmax())
        q = qd.to(device)
    d2 = int(np.argsort(-p[1])[1])
    n = 40000
    outs = verify_many(logits, [d1, d2], PARAMS, n, q)
    first = np.bincount([o[0] for o in outs], minlength=V)
    stat, crit = chi2(first, p[0])
    assert stat < crit, (proposer, stat, crit)
    after = [o[1] for o in outs if o[0] == d1]  # the token after an accepted first draft
    if len(after) > 2000:
        stat, crit = chi2(np.bincount(after, minlength=V), p[1])
        assert stat < crit, (proposer, "second", stat, crit)
    if proposer == "outside":
        assert all(len(o) == 1 for o in outs)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verification_is_exact(device):
    logits = logits_for(11, 5, device)
    target = logits.argmax(dim=-1).tolist()
    greedy = SamplingParams(temperature=0)
    for a in range(5):  # drafts that match the argmax for the first a positions
        drafts = target[:a] + [(target[a] + 1) % V] * (4 - a) if a < 4 else target[:4]
        got = verify_many(logits, drafts, greedy, 1)[0]
        assert got == target[: min(a, 4) + 1] if a < 4 else got == target


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_verification_does_not_depend_on_the_batch(device):
    logits = logits_for(5, 3, device)
    seeded = SamplingParams(temperature=1.0, seed=42)

    def run(others: int) -> list[int]:
        batch = torch.cat([logits, logits_for(9, 3 * others, device)]) if others else logits
        g = torch.Generator(device=device).manual_seed(42)
        entries = [DraftRows("seeded", 0, [1, 2], seeded, g)]
        entries += [DraftRows(f"o{i}", 3 * (i + 1), [3, 4], SamplingParams(temperature=1.0)) for i in range(others)]
        return launch_verify(batch, entries).collect()["seeded"]

    assert run(0) == run(4) == run(7)


def test_filtered_probs_match_the_reference():
    logits = logits_for(13, 4, "cpu")
    params = [PARAMS, SamplingParams(temperature=0.5), SamplingParams(top_p=0.5), SamplingParams(temperature=0)]
    got = filtered_probs(logits, params).numpy()
    for i, sp in enumerate(params[:3]):
        np.testing.assert_allclose(got[i], reference(logits[i].numpy(), sp.temperature, sp.top_k if sp.top_k > 0 else 0,
                                                     sp.top_p, sp.min_p), atol=1e-5)
    assert got[3].argmax() == logits[3].argmax() and got[3].max() == 1.0
