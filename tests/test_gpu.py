"""The engine on a CUDA GPU (skipped without one): a small random Llama checked against
transformers on the same weights. fp32: token-identical, logits within 1e-3 of the largest. bf16:
the first step's logits are no further from the fp32 reference than twice transformers' own
bf16 error (plus 1e-3 of the largest logit)."""
from __future__ import annotations

import pytest
import torch

from kvos import SamplingParams
from tests.test_hf_parity import hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 4096


def make_model_folder(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                      rope_theta=500000.0, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", bos_token="t1").save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-llama")
    return path, make_model_folder(path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_on_gpu_matches_transformers(folder, dtype):
    from kvos import LLM

    import copy

    path, cpu_model = folder
    ref32 = copy.deepcopy(cpu_model).to("cuda", torch.float32)
    hf = copy.deepcopy(cpu_model).to("cuda", getattr(torch, dtype))
    llm = LLM(model=str(path), device="cuda", dtype=dtype, num_blocks=512, block_size=16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 64, 300, 1200)]
    logits: dict[str, list[torch.Tensor]] = {}
    llm.engine.runner.logits_hook = lambda ids, rows: [logits.setdefault(i, []).append(r.clone())
                                                       for i, r in zip(ids, rows)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref_tokens, ref_logits = hf_greedy(hf, p, 16)
        ref_logits = [x.float() for x in ref_logits]
        if dtype == "float32":
            assert o.outputs[0].token_ids == ref_tokens
        # the first step's logits (same prefix for both, whatever later tokens do)
        ours, theirs = logits[o.request_id][0], ref_logits[0]
        if dtype == "float32":
            assert (ours - theirs).abs().max().item() <= 1e-3 * theirs.abs().max().item()
        else:
            with torch.inference_mode():
                exact = ref32(torch.tensor([p], device="cuda")).logits[0, -1].float()
            hf_err = (theirs - exact).abs().max().item()
            our_err = (ours - exact).abs().max().item()
            assert our_err <= 2 * hf_err + 1e-3 * exact.abs().max().item(), (our_err, hf_err)
    assert llm.stats()["used"] == 0
