"""The sampling kernels (kvos.kernels.top_p): the full vocabulary's (``nucleus_sample``), the
top-k candidates' (``ranked_sample``), and the sampler's paths through them.

Every drawn token lies in the float64 kept set (top-p: the probabilities strictly above it sum to
less than p; min-p: at least min_p times the top probability) on peaked, near-flat and tied rows,
bf16 and float32 logits, at several temperatures, except tokens whose float64 mass above is
within 1e-5 of p (float32 summation order decides those); small kept sets are covered by the
draws; masses that sum exactly put the boundary where the rule says. Then the sampler with the
kernel on: chi-square against the filtered softmax (rows that need many rejection rounds among
them, and top-k rows), and a mixed batch whose seeded rows draw what they draw alone, without
any sort. Without a GPU the kernels run in Triton's interpreter on small CPU tensors.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import (  # first: before triton loads
    CUDA,
    skip_unless_interpreted,
)

triton = pytest.importorskip("triton")

from kvos.core.sampling_params import SamplingParams  # noqa: E402
from kvos.kernels import top_p as _top_p  # noqa: E402
from kvos.worker import sampler as _sampler  # noqa: E402
from kvos.worker.sampler import Sampler, SampleRow, SeedStream, sorted_top_p_threshold  # noqa: E402
from tests.worker.test_sampler_distribution import check_frequencies  # noqa: E402

pytestmark = pytest.mark.gpu

skip_unless_interpreted(_top_p._nucleus_kernel, _top_p._ranked_kernel)

DEVICE = torch.device("cuda" if CUDA else "cpu")
NEAR = 1e-5


def mass_above(probs: torch.Tensor) -> torch.Tensor:
    """Float64: per token, the sum of its row's probabilities strictly greater than it."""
    x = probs.double()
    asc = x.sort(dim=-1).values
    suffix = torch.cat([asc.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(asc[:, :1])], dim=-1)
    return suffix.gather(1, torch.searchsorted(asc, x, right=True))


def kept_sets(x: torch.Tensor, temp: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 rule on logits ``x`` [R, V] at ``temp``: (kept, unsure), boolean [R, V]; unsure
    marks tokens within float32 rounding of either boundary."""
    probs = torch.softmax(x.double() / temp.double()[:, None], dim=-1)
    above = mass_above(probs)
    ratio = probs / probs.max(dim=-1, keepdim=True).values
    kept = (above < p.double()[:, None]) & (ratio >= min_p.double()[:, None])
    unsure = ((above - p.double()[:, None]).abs() <= NEAR) | ((ratio - min_p.double()[:, None]).abs() <= 1e-5)
    return kept, unsure


def draws(x: torch.Tensor, temp: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """[n, R] tokens: the kernel's draws for ``n`` copies of the rows in one batch, each row under
    its own seed."""
    R = x.shape[0]
    seeds = torch.randint(0, 1 << 62, (n * R,), generator=torch.Generator().manual_seed(1))
    got = _top_p.nucleus_sample(x.repeat(n, 1).to(DEVICE), temp.repeat(n).to(DEVICE), p.repeat(n).to(DEVICE),
                                min_p.repeat(n).to(DEVICE), seeds.to(DEVICE), **kw)
    return got.cpu().view(n, R)


def rows(V: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Peaked, ordinary, near-flat and tied rows with their temperature, p and min-p."""
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(V, generator=g) * s for s in (8.0, 8.0, 2.0, 2.0, 0.01, 0.05, 1.0, 3.0)]
    x += [torch.randint(0, 4, (V,), generator=g).float() * s for s in (1.0, 0.3)]  # many ties
    temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0, 1.0, 0.9, 1.0, 1.0])
    p = torch.tensor([0.1, 0.5, 0.9, 0.95, 0.999, 1.0, 0.3, 0.6, 0.5, 0.95])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.2, 0.0, 0.0])
    return torch.stack(x).to(dtype), temp, p, min_p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V, block", [(1000, 256), (77, 128), (3000, 1024)])
def test_drawn_tokens_lie_in_the_float64_kept_set(V, block, dtype):
    x, temp, p, min_p = rows(V, V, dtype)
    got = draws(x, temp, p, min_p, 20, block=block)
    kept, unsure = kept_sets(x, temp, p, min_p)
    inside = kept.gather(1, got.T) | unsure.gather(1, got.T)
    assert inside.all(), [(r, got[:, r][~inside[r]].tolist()[:5]) for r in range(len(p)) if not inside[r].all()]
    for r in range(len(p)):  # a kept set of a few tokens is covered by the 20 draws
        if 0 < kept[r].sum() <= 3 and not unsure[r].any():
            assert set(got[:, r].tolist()) == set(torch.nonzero(kept[r]).flatten().tolist()), r


def test_exact_boundaries_and_ties():
    """Masses that sum exactly (powers of two; T = 1): a token whose mass above is below p is
    drawn, one whose mass above reaches p never is, and tied tokens go together."""
    probs = torch.tensor([[0.25, 0.125, 0.25, 0.125, 0.25],  # tied tops: mass above 0 for all three
                          [0.5, 0.25, 0.125, 0.0625, 0.0625],
                          [0.5, 0.25, 0.125, 0.0625, 0.0625],
                          [0.5, 0.25, 0.125, 0.0625, 0.0625]])
    p = torch.tensor([0.1, 0.7499, 0.7501, 0.8749])
    got = draws(probs.log(), torch.ones(4), p, torch.zeros(4), 60, block=4)  # V not a multiple of the block
    assert [sorted(set(got[:, r].tolist())) for r in range(4)] == [[0, 2, 4], [0, 1], [0, 1, 2], [0, 1, 2]]


def test_sorted_threshold_of_the_cpu_path_matches_the_rule():
    """The CPU path's threshold (``sorted_top_p_threshold``): ``probs >= tau`` is the float64 kept set."""
    x, temp, p, min_p = rows(1000, 0, torch.float32)
    probs = torch.softmax(x / temp[:, None], dim=-1)
    kept, unsure = kept_sets(x, temp, p, torch.zeros_like(min_p))
    mine = probs >= sorted_top_p_threshold(probs, p)[:, None]
    assert not ((mine != kept) & ~unsure).any()


@pytest.fixture
def kernel_on(monkeypatch):
    """The sampler's kernels (full vocabulary and top-k candidates), even on CPU tensors;
    records the rows of each call."""
    monkeypatch.setattr(_sampler, "SAMPLING_KERNELS_ON_CPU", True)
    calls = []
    for name in ("nucleus_sample", "ranked_sample"):
        def counted(x, *args, kernel=getattr(_top_p, name), **kw):
            calls.append(x.shape[0])
            return kernel(x, *args, **kw)
        monkeypatch.setattr(_top_p, name, counted)
    return calls


@pytest.mark.parametrize("vocab, params, neighbour", [
    (1000, SamplingParams(temperature=0.7, top_p=0.9), None),
    (1000, SamplingParams(temperature=1.2, top_p=0.95, min_p=0.02), None),
    (500, SamplingParams(temperature=4.0, top_p=0.2), None),  # near-flat: many rejection rounds
    (300, SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=1.0, top_k=5)),  # mixed
    (200, SamplingParams(temperature=0.8, top_p=0.95, top_k=50), None),  # the top-k candidates' kernel
    (200, SamplingParams(temperature=1.3, top_k=20, min_p=0.05), None),
    (200, SamplingParams(temperature=1.5, top_k=8), SamplingParams(temperature=1.0, top_k=60)),  # mixed k
])
def test_kernel_path_frequencies_match_the_filtered_softmax(vocab, params, neighbour, kernel_on):
    check_frequencies(vocab, params, DEVICE, neighbour, n=60_000 if CUDA else 8_000)
    assert kernel_on  # a kernel did the filtering


@pytest.mark.parametrize("kernel,streams", [(True, False), (True, True), (False, False)])
def test_mixed_batch_rows_draw_what_they_draw_alone(kernel, streams, monkeypatch):
    """One batch of a top-k row, a top-p-only row and a greedy row (all seeded): each row's
    tokens equal those of the row sampled alone with the same seed, with the kernels' seeds from
    the rows' generators or from host seed streams. With the kernel, no step sorts anything."""
    monkeypatch.setattr(_sampler, "SAMPLING_KERNELS_ON_CPU", kernel)
    if kernel:
        def no_sort(*args, **kwargs):
            raise AssertionError("the kernel path sorted")
        monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 500, generator=g) * 2).to(DEVICE)
    params = [SamplingParams(temperature=0.9, top_k=5, seed=11),
              SamplingParams(temperature=0.9, top_p=0.9, seed=12), SamplingParams(temperature=0.0, seed=13)]

    def run(indices: list[int], steps: int = 8) -> list[list[int]]:
        gens = {i: torch.Generator(device=DEVICE).manual_seed(params[i].seed) for i in indices}
        seed_streams = {i: SeedStream(params[i].seed) if streams else None for i in indices}
        out = []
        for _ in range(steps):
            batch = [SampleRow(j, params[i], None if streams else gens[i], seed_stream=seed_streams[i])
                     for j, i in enumerate(indices)]
            out.append(Sampler._sample(logits[indices], batch).tolist())
        return [list(col) for col in zip(*out)]

    together = run([0, 1, 2])
    for i in range(3):
        assert together[i] == run([i])[0], i
    assert together[2] == [logits[2].argmax().item()] * 8
    assert len(set(together[1])) > 1  # the top-p row really samples
