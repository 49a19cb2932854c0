"""Idefics3 / SmolVLM (a tiny random checkpoint written by transformers, with its processor) in
the engine on the CPU in fp32 against transformers on the same folder: prompt ids equal to the
processor's (tiles, row/column tags, global view), greedy tokens identical and per-step logits
within 1e-3 of the largest, with one and two images of different tilings, in a first and a later
turn, in chunks; each tile is one encoder-cache entry, so a later turn encodes nothing again."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvos import LLM, SamplingParams
from tests.support.vlm_checkpoints import IDEFICS3_TOKENS, write_idefics3_checkpoint

NEW_TOKENS = 6
BLOCK = 4


def image(seed: int, size=(40, 50)):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    path = write_idefics3_checkpoint(tmp_path_factory.mktemp("idefics3"))
    hf = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, AutoProcessor.from_pretrained(path), hf


@torch.inference_mode()
def hf_reference(ref, messages, images):
    _, proc, hf = ref
    hf_msgs = [{**m, "content": [{"type": "image"} if p["type"] != "text" else p for p in m["content"]]}
               if isinstance(m["content"], list) else m for m in messages]
    text = proc.apply_chat_template(hf_msgs, add_generation_prompt=True)
    inputs = proc(text=text, images=[images] if images else None, return_tensors="pt")
    out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                      output_logits=True, return_dict_in_generate=True)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out.sequences[0, n:].tolist(), [r[0].float() for r in out.logits]


def check(ref, llm, messages, images):
    ids, tokens, ref_logits = hf_reference(ref, messages, images)
    logits = []
    llm.engine.runner.logits_hook = lambda _, rows: logits.extend(r.float().cpu() for r in rows)
    try:
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                       use_tqdm=False)[0]
    finally:
        llm.engine.runner.logits_hook = None
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == tokens
    for step, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
        err, tol = (a - b).abs().max().item(), 1e-3 * b.abs().max().item()
        assert err <= tol, f"step {step}: {err:.2e} > {tol:.2e}"
    return out, logits


def user(*parts):
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


def img(im):
    return {"type": "image", "image": im}


def runs(llm) -> int:
    return llm.stats()["encoder"]["encoder_runs"]


def test_idefics3_matches_transformers_with_tiles_in_first_and_later_turns(idefics3):
    llm = LLM(model=str(idefics3[0]), block_size=BLOCK, kv_cache_memory_bytes=16 << 20)
    square, wide = image(0), image(1, (20, 60))  # 3 x 3 tiles + global view; 1 x 3 + global view
    first = [user(img(square), "what is in this picture?")]
    out, logits = check(idefics3, llm, first, [square])
    assert runs(llm) == 10  # one encoder input per tile
    _, other = check(idefics3, llm, [user(img(image(5)), "what is in this picture?")], [image(5)])
    assert (logits[0] - other[0]).abs().max() > 1e-2  # the image's encoding reaches the logits
    later = first + [{"role": "assistant", "content": llm.get_tokenizer().decode(out.outputs[0].token_ids)},
                     user("and this one?", img(wide))]
    before = runs(llm)
    out2, _ = check(idefics3, llm, later, [square, wide])
    tok = llm.engine.media.vision.image_token_id
    last_square = max(i for i, t in enumerate(out2.prompt_token_ids[: len(out.prompt_token_ids)]) if t == tok)
    assert out2.num_cached_tokens > last_square  # the first image's tiles hit the prefix cache
    assert runs(llm) == before + 4  # only the new image's tiles were encoded
    assert sum(t == tok for t in out2.prompt_token_ids) == 14 * IDEFICS3_TOKENS


def test_idefics3_chunked_prefill_and_the_encoder_cache_after_eviction(idefics3):
    """Chunks of 24 tokens (a tile's 16 never split), no prefix caching: the second request
    reuses every tile's encoding from the encoder cache and still matches."""
    llm = LLM(model=str(idefics3[0]), block_size=BLOCK, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=24,
              enable_prefix_caching=False)
    a, b = image(2, (30, 30)), image(3, (50, 20))
    msgs = [user("the quick brown fox", img(a), "jumps over", img(b), "the lazy dog.")]
    check(idefics3, llm, msgs, [a, b])
    before = runs(llm)
    out, _ = check(idefics3, llm, msgs, [a, b])
    assert out.num_cached_tokens == 0 and runs(llm) == before


def test_smolvlm_architecture_and_text_prompt_with_multi_modal_data(idefics3, tmp_path):
    """The same weights declared as ``SmolVLMForConditionalGeneration`` load as Idefics3; a
    text prompt with ``<image>`` placeholders and ``multi_modal_data`` (vLLM's form) expands to
    the processor's ids."""
    import shutil

    path = tmp_path / "smolvlm"
    shutil.copytree(idefics3[0], path)
    import json

    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["SmolVLMForConditionalGeneration"],
                                                   "model_type": "smolvlm"}))
    llm = LLM(model=str(path), block_size=BLOCK, kv_cache_memory_bytes=16 << 20)
    _, proc, hf = idefics3
    a = image(7, (25, 70))
    text = "<|im_start|>User:<image>describe it in one word.<end_of_utterance>\nAssistant:"
    inputs = proc(text=text, images=[[a]], return_tensors="pt")
    with torch.inference_mode():
        ref = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": a}},
                       SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
    with pytest.raises(ValueError, match="holds 1 <image> placeholder"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": [a, a]}}, SamplingParams(max_tokens=1),
                     use_tqdm=False)


def test_idefics3_config_refuses_what_it_cannot_run():
    from kvos.models.config import ModelConfig

    base = {"architectures": ["Idefics3ForConditionalGeneration"], "scale_factor": 2,
            "text_config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 300},
            "vision_config": {"image_size": 32, "patch_size": 4}}
    cfg = ModelConfig.from_hf(base)
    assert cfg.arch == "llama" and cfg.vision.family == "idefics3" and cfg.vision.tokens_per_image == 16
    with pytest.raises(ValueError, match="text model of type 'qwen2'"):
        ModelConfig.from_hf({**base, "text_config": {**base["text_config"], "model_type": "qwen2"}})
    with pytest.raises(ValueError, match="scale_factor=3"):
        ModelConfig.from_hf({**base, "scale_factor": 3})


def test_planner_counts_the_tiles_encoder_and_the_largest_images_tokens(idefics3):
    """``kvos plan`` on the folder: the encoder's parameters are the engine's (tower and
    connector); an image adds what the engine's prompt holds for the largest tiling (3 x 3 tiles
    here, from the processor's config), within the newline tokens that merge with their
    neighbours."""
    from kvos.sim.hardware import resolve_gpu
    from kvos.sim.planner import PlanInput, plan
    from kvos.sim.shapes import resolve_shape

    llm = LLM(model=str(idefics3[0]), block_size=BLOCK, kv_cache_memory_bytes=16 << 20)
    model = llm.engine.runner.model
    encoder = sum(p.numel() for m in (model.vision_model, model.modality_projection) for p in m.parameters())
    shape = resolve_shape(str(idefics3[0]))
    assert shape.vision.max_tiles_per_side == 3
    r = plan(PlanInput(shape, resolve_gpu("H200"), context_len=100, images_per_request=1))
    assert r["vision_params"] == encoder
    text = llm.chat_token_ids([user("what is in this picture?")])
    with_image = llm.chat_token_ids([user(img(image(0)), "what is in this picture?")])
    assert abs(r["image_tokens_per_request"] - (len(with_image) - len(text))) <= 4
