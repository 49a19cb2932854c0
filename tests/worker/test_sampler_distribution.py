"""The sampler draws from the filtered softmax: chi-square goodness of fit against an independent
float64 reference of temperature, top-k, top-p and min-p (fixed seeds; on the CPU, and on a GPU
when there is one: `make test-gpu`), on the top-k path, the full-sort path and the full-vocabulary
path (top-p by a threshold: a sort on the CPU, the Triton kernel on CUDA), alone and in split
batches; a seeded row's tokens do not depend on its batch."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvos.core.sampling_params import SamplingParams
from kvos.worker.sampler import Sampler, SampleRow

pytestmark = pytest.mark.gpu


def reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """vLLM's order: temperature, top-k, top-p over what top-k kept, then min-p; float64."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros_like(x, dtype=bool)
    keep[order[: top_k or len(x)]] = True
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    mass_before = np.cumsum(p[order]) - p[order]
    drop = order[(mass_before >= top_p) & (np.arange(len(x)) > 0)]
    p[drop] = 0.0
    p /= p.sum()
    p[p < min_p * p.max()] = 0.0
    return p / p.sum()


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.719: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def draw(logits: torch.Tensor, params: SamplingParams, n: int, rows: int = 2000,
         neighbour: SamplingParams | None = None) -> np.ndarray:
    """Counts of ``n`` draws with ``params``; with a ``neighbour``, every other row of each batch
    samples with it instead (and is not counted)."""
    counts = np.zeros(logits.shape[0], dtype=np.int64)
    batch = logits[None, :].expand(rows, -1).contiguous()
    step = rows // 2 if neighbour else rows
    for _ in range(n // step):
        row_params = [neighbour if neighbour and i % 2 else params for i in range(rows)]
        tokens = Sampler._sample(batch, [SampleRow(i, sp) for i, sp in enumerate(row_params)])
        tokens = tokens.cpu().numpy()
        counts += np.bincount(tokens[::2] if neighbour else tokens, minlength=logits.shape[0])
    return counts


@pytest.mark.parametrize("vocab, params, neighbour", [
    (200, SamplingParams(temperature=0.8, top_p=0.95, top_k=50), None),  # the top-k path
    (200, SamplingParams(temperature=1.3, top_k=20, min_p=0.05), None),
    (200, SamplingParams(temperature=1.5, top_k=8), SamplingParams(temperature=1.0, top_k=60)),  # mixed k
    (3000, SamplingParams(temperature=0.7, top_p=0.9), None),  # no top-k: the full-vocabulary path
    (3000, SamplingParams(temperature=1.0, top_p=0.8, min_p=0.02), None),
    (3000, SamplingParams(temperature=4.0, top_k=1100), None),  # top_k above the candidates: sort
    (200, SamplingParams(temperature=1.5, top_k=8), SamplingParams(temperature=1.0)),  # split batch
    (300, SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=1.0, top_k=5)),  # split
    (200, SamplingParams(temperature=0.9), None),  # unfiltered
])
@pytest.mark.parametrize("device", DEVICES)
def test_sampled_frequencies_match_the_filtered_softmax(vocab, params, neighbour, device):
    check_frequencies(vocab, params, device, neighbour)


def check_frequencies(vocab: int, params: SamplingParams, device, neighbour: SamplingParams | None,
                      n: int = 60_000) -> None:
    """Draw ``n`` tokens from seeded random logits of ``vocab`` tokens: nothing the filters
    remove is ever drawn, and the frequencies pass a chi-square test against the float64
    filtered softmax."""
    torch.manual_seed(0)
    logits = torch.randn(vocab) * 3
    p = reference(logits.numpy(), params.temperature, params.top_k, params.top_p, params.min_p)
    counts = draw(logits.to(device), params, n, neighbour=neighbour)
    assert counts[p == 0].sum() == 0  # nothing the filters removed is ever drawn
    support = p > 0
    expected = p[support] * n
    big = expected >= 5  # pool the rare tokens into one cell, as the test requires
    obs = np.append(counts[support][big], counts[support][~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert stat < chi2_critical(len(exp) - 1), (stat, len(exp))


def test_seeded_rows_do_not_depend_on_their_batch():
    torch.manual_seed(1)
    V = 300
    logits = torch.randn(4, V) * 2
    mine = [SamplingParams(temperature=0.8, top_k=40, seed=7), SamplingParams(temperature=0.8, top_p=0.9, seed=8),
            SamplingParams(temperature=1.0, seed=9)]

    for i, sp in enumerate(mine):  # alone, with a top-k row, an unfiltered row, a greedy and a top-p row
        alone = [t[0] for t in run_alone(logits[i], sp)]
        for others in ([SamplingParams(temperature=0.5, top_k=5)], [SamplingParams(temperature=0.5)],
                       [SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)]):
            gen = torch.Generator().manual_seed(sp.seed)
            got = []
            for _ in range(20):
                rows = [SampleRow(0, sp, gen)] + [SampleRow(j + 1, o) for j, o in enumerate(others)]
                x = torch.cat([logits[i: i + 1], logits[1: 1 + len(others)]])
                got.append(Sampler._sample(x, rows)[0].item())
            assert got == alone, (sp, others)


def run_alone(row_logits: torch.Tensor, sp: SamplingParams) -> list[list[int]]:
    gen = torch.Generator().manual_seed(sp.seed)
    return [Sampler._sample(row_logits[None], [SampleRow(0, sp, gen)]).tolist() for _ in range(20)]
