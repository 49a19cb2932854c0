"""The sort-free top-p threshold (kvos.kernels.top_p) and the sampler's full-vocabulary path.

Kept sets ``probs >= tau`` against the float64 rule (a token is kept iff the probabilities
strictly above it sum to less than p) on peaked, near-flat and tied rows, except tokens whose
float64 mass above is within 1e-5 of p (float32 summation order decides those). The same search on logits at a temperature (the
sampler's mode), then the sampler with the kernels on: chi-square against the filtered softmax, and a mixed batch (top-k,
top-p only, greedy) whose seeded rows draw what they draw alone, without any sort. Without a GPU
the kernel runs in Triton's interpreter on small CPU tensors (milliseconds a row).
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import CUDA, skip_unless_interpreted  # first: before triton loads

triton = pytest.importorskip("triton")

from kvos.engine.sampling_params import SamplingParams  # noqa: E402
from kvos.kernels import top_p as _top_p  # noqa: E402
from kvos.model import sampler as _sampler  # noqa: E402
from kvos.model.sampler import Sampler, SampleRow, sorted_top_p_threshold  # noqa: E402
from tests.test_sampler_distribution import check_frequencies  # noqa: E402

top_p_threshold = _top_p.top_p_threshold
top_p_threshold_reference = _top_p.top_p_threshold_reference

skip_unless_interpreted(_top_p._threshold_kernel, _top_p._race_kernel)

DEVICE = torch.device("cuda" if CUDA else "cpu")
PS = [0.1, 0.5, 0.9, 0.95, 0.999]
NEAR = 1e-5


def mass_above(probs: torch.Tensor) -> torch.Tensor:
    """Float64: per token, the sum of its row's probabilities strictly greater than it."""
    x = probs.double()
    asc = x.sort(dim=-1).values
    suffix = torch.cat([asc.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(asc[:, :1])], dim=-1)
    return suffix.gather(1, torch.searchsorted(asc, x, right=True))


def check_kept_sets(probs: torch.Tensor, p: torch.Tensor, tau: torch.Tensor, exact: bool = False) -> None:
    """``probs >= tau`` is the float64 rule's kept set, except near the boundary (nowhere with
    ``exact``); the most probable token is kept; ``p >= 1`` keeps everything."""
    kept = probs >= tau[:, None]
    above = mass_above(probs)
    want = above < p.double()[:, None]
    near = (above - p.double()[:, None]).abs() <= NEAR
    wrong = (kept != want) & (torch.zeros_like(near) if exact else ~near)
    assert not wrong.any(), [(r, torch.nonzero(wrong[r]).flatten().tolist()[:5], p[r].item())
                             for r in range(len(p)) if wrong[r].any()]
    assert kept.gather(1, probs.argmax(dim=-1, keepdim=True)).all()
    assert kept[p >= 1].all()
    is_value = (probs == tau[:, None]).any(dim=-1) | (tau == 0)  # tau is one of the row's values
    assert is_value.all()


def rows(V: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Peaked, ordinary, near-flat and tied rows (two of each), each p of PS and 1.0 among them."""
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(V, generator=g) * s for s in (8.0, 8.0, 2.0, 2.0, 0.01, 0.01)]
    logits += [torch.randint(0, 4, (V,), generator=g).float() * s for s in (1.0, 0.3)]  # many ties
    probs = torch.stack(logits).softmax(dim=-1)
    p = torch.tensor(PS + [1.0] + PS[:2], dtype=torch.float32)[torch.randperm(8, generator=g)]
    return probs.to(DEVICE), p.to(DEVICE)


# the search's paths: the default (passes over the row, then the interval's values in registers),
# straight to registers, and values that never fit the slots (every pass over the row)
SEARCHES = [{}, {"full_passes": 0, "cap": 4096}, {"full_passes": 1, "cap": 8}]


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("V, block", [(1000, 256), (77, 128), (513, 512), (3000, 1024)])
def test_kernel_kept_set_matches_the_float64_rule(V, block, search):
    for seed in range(2):
        probs, p = rows(V, seed)
        tau = top_p_threshold(probs, p, block=block, **search)
        check_kept_sets(probs, p, tau)
        check_kept_sets(probs, p, top_p_threshold_reference(probs, p), exact=True)
        check_kept_sets(probs, p, sorted_top_p_threshold(probs, p))  # the sampler's CPU path


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("V, block", [(1000, 256), (77, 128), (3000, 1024)])
def test_logit_threshold_kept_set_matches_the_float64_rule(V, block, search):
    """The sampler's mode: the threshold searched on logits at a temperature (``u = exp(x / T -
    m)``, bf16 and float32 logits), its kept set ``u >= cut`` against the float64 rule on the
    softmax, except tokens whose u is within float32 rounding of the cut (torch's exp here,
    the kernel's there) or whose mass above is within 1e-5 of p."""
    g = torch.Generator().manual_seed(V)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.stack([torch.randn(V, generator=g) * s for s in (8.0, 2.0, 2.0, 0.05, 1.0, 4.0, 1.0, 3.0)])
        x = x.to(dtype)
        temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0, 1.0, 0.9])
        p = torch.tensor(PS + [1.0, 0.3, 0.6])
        cut, m = _top_p.logit_threshold(x.to(DEVICE), (1 / temp).to(DEVICE), p.to(DEVICE), block=block, **search)
        cut, m = cut.cpu(), m.cpu()
        scaled = x.float() * (1 / temp)[:, None]
        assert torch.equal(m, scaled.max(dim=-1).values)
        u = torch.exp(scaled - m[:, None])
        kept = u >= cut[:, None]
        above = mass_above(torch.softmax(scaled.double(), dim=-1))
        want = above < p.double()[:, None]
        unsure = ((above - p.double()[:, None]).abs() <= NEAR) | ((u - cut[:, None]).abs() <= 1e-6 * cut[:, None])
        assert not ((kept != want) & ~unsure).any()
        assert (cut[p >= 1] == 0).all() and (cut <= 1).all()


def test_kernel_ties_and_exact_boundaries():
    """Ties are kept or dropped together, and masses that sum exactly (powers of two) put the
    boundary exactly where the rule says: mass above < p keeps, == p drops."""
    probs = torch.tensor([[0.25, 0.125, 0.25, 0.125, 0.25],  # tied tops: above = 0 for all three
                          [0.5, 0.25, 0.125, 0.0625, 0.0625],
                          [0.5, 0.25, 0.125, 0.0625, 0.0625],
                          [0.5, 0.25, 0.125, 0.0625, 0.0625]], device=DEVICE)
    p = torch.tensor([0.1, 0.75, 0.7501, 0.875], device=DEVICE)
    for search in SEARCHES:
        tau = top_p_threshold(probs, p, block=4, **search)  # V not a multiple of the block
        assert tau.tolist() == [0.25, 0.25, 0.125, 0.125], search
    assert top_p_threshold_reference(probs, p).tolist() == tau.tolist()
    assert sorted_top_p_threshold(probs, p).tolist() == tau.tolist()


@pytest.fixture
def kernel_on(monkeypatch):
    """The sampler's full-vocabulary path on the Triton kernels, even on CPU tensors. Under the
    interpreter the threshold kernel runs once per distinct (row, temperature, p): a batch of
    identical rows costs one search (the race still runs every row)."""
    monkeypatch.setattr(_sampler, "TOP_P_KERNEL_ON_CPU", True)
    calls = []
    threshold = _top_p.logit_threshold

    def deduplicated(x, inv_t, top_p, **kw):
        calls.append(x.shape[0])
        if CUDA:
            return threshold(x, inv_t, top_p, **kw)
        key = torch.cat([x.float(), inv_t[:, None], top_p[:, None]], dim=1)
        uniq, inverse = key.unique(dim=0, return_inverse=True)
        cut, m = threshold(uniq[:, :-2].contiguous(), uniq[:, -2].contiguous(), uniq[:, -1].contiguous(), **kw)
        return cut[inverse], m[inverse]

    monkeypatch.setattr(_top_p, "logit_threshold", deduplicated)
    return calls


@pytest.mark.parametrize("vocab, params, neighbour", [
    (1000, SamplingParams(temperature=0.7, top_p=0.9), None),
    (1000, SamplingParams(temperature=1.2, top_p=0.95, min_p=0.02), None),
    (300, SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=1.0, top_k=5)),  # mixed
])
def test_kernel_path_frequencies_match_the_filtered_softmax(vocab, params, neighbour, kernel_on):
    # the race runs every draw in the interpreter (about a microsecond a token): fewer draws there
    check_frequencies(vocab, params, DEVICE, neighbour, n=60_000 if CUDA else 6_000)
    assert kernel_on  # the kernel did the filtering


@pytest.mark.parametrize("kernel", [True, False])
def test_mixed_batch_rows_draw_what_they_draw_alone(kernel, monkeypatch):
    """One batch of a top-k row, a top-p-only row and a greedy row (all seeded): each row's
    tokens equal those of the row sampled alone with the same seed. With the kernel, no step
    sorts anything."""
    monkeypatch.setattr(_sampler, "TOP_P_KERNEL_ON_CPU", kernel)
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
        out = []
        for _ in range(steps):
            batch = [SampleRow(j, params[i], gens[i]) for j, i in enumerate(indices)]
            out.append(Sampler._sample(logits[indices], batch).tolist())
        return [list(col) for col in zip(*out)]

    together = run([0, 1, 2])
    for i in range(3):
        assert together[i] == run([i])[0], i
    assert together[2] == [logits[2].argmax().item()] * 8
    assert len(set(together[1])) > 1  # the top-p row really samples
