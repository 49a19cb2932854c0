"""Gemma 3 as a vision-language model (a tiny random checkpoint written by transformers, with its
processor) in the engine on the CPU in fp32 against transformers on the same folder: prompt ids
equal to the processor's, greedy tokens identical and per-step logits within 1e-3 of the largest,
with one and two images, in a first and a later turn, in chunks; image-aware prefix hashing and
the encoder cache (the metric says when the encoder ran); bad images refused by name."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from kvos import LLM, SamplingParams
from tests.support.vlm_checkpoints import IMAGE_TOKENS, write_checkpoint

NEW_TOKENS = 8
BLOCK = 4


def image(seed: int, size=(40, 50)):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8"))


def png_data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    path = write_checkpoint(tmp_path_factory.mktemp("gemma3-vlm"))
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, AutoProcessor.from_pretrained(path), hf


@torch.inference_mode()
def hf_reference(vlm, messages, images):
    """The processor's prompt ids and transformers' greedy tokens and per-step logits."""
    _, proc, hf = vlm
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    inputs = proc(text=text, images=images or None, return_tensors="pt")
    out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                      output_logits=True, return_dict_in_generate=True)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out.sequences[0, n:].tolist(), [r[0].float() for r in out.logits]


def hf_messages(messages):
    """The messages as the processor's template takes them (images as bare parts)."""
    return [{**m, "content": [{"type": "image"} if p["type"] != "text" else p for p in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]


def chat(llm, messages, salt=None):
    logits = []
    llm.engine.runner.logits_hook = lambda ids, rows: logits.extend(r.float().cpu() for r in rows)
    try:
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                       use_tqdm=False, cache_salt=salt)[0]
    finally:
        llm.engine.runner.logits_hook = None
    return out, logits


def check(vlm, llm, messages, images, salt=None):
    ids, tokens, ref_logits = hf_reference(vlm, hf_messages(messages), images)
    out, logits = chat(llm, messages, salt)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == tokens
    for step, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
        err, tol = (a - b).abs().max().item(), 1e-3 * b.abs().max().item()
        assert err <= tol, f"step {step}: {err:.2e} > {tol:.2e}"
    return out


def user(*parts):
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


def img_part(img):
    return {"type": "image", "image": img}


def encoder(llm) -> dict:
    return llm.stats()["encoder"]


def test_images_match_transformers_in_first_and_later_turns(vlm):
    path = vlm[0]
    llm = LLM(model=str(path), block_size=BLOCK, kv_cache_memory_bytes=8 << 20)
    a, b = image(0), image(1)
    first = [user(img_part(a), "what is in this picture?")]
    out = check(vlm, llm, first, [a])
    assert encoder(llm)["encoder_runs"] == 1
    # two images in one turn (the second given as a PNG data URL, as the OpenAI API sends it)
    two = [user(img_part(a), "compare these two images.", {"type": "image_url", "image_url": {"url": png_data_url(b)}})]
    check(vlm, llm, two, [a, b])
    assert encoder(llm)["encoder_runs"] == 2  # a came from the encoder cache
    # a later turn: the first turn's image is in the cached prefix; the new image is encoded once
    later = first + [{"role": "assistant", "content": llm.get_tokenizer().decode(out.outputs[0].token_ids)},
                     user("and this one?", img_part(image(2)))]
    runs = encoder(llm)["encoder_runs"]
    out2 = check(vlm, llm, later, [a, image(2)])
    span = [i for i, t in enumerate(out2.prompt_token_ids) if t == llm.engine.media.vision.image_token_id]
    assert out2.num_cached_tokens >= span[IMAGE_TOKENS - 1] + 1  # past the first image
    assert encoder(llm)["encoder_runs"] == runs + 1


def test_chunked_prefill_never_splits_an_image_and_matches(vlm):
    """Chunks of 6 tokens, images of 4 at offsets that a plain 6-token cut would split: each
    image's tokens attend to each other both ways, in one step."""
    llm = LLM(model=str(vlm[0]), block_size=BLOCK, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=6,
              enable_prefix_caching=False)
    a, b = image(3), image(4)
    check(vlm, llm, [user("the quick brown fox", img_part(a), "jumps over", img_part(b), "the lazy dog.")], [a, b])


def test_different_images_never_share_kv_and_the_same_one_hits(vlm):
    llm = LLM(model=str(vlm[0]), block_size=BLOCK, kv_cache_memory_bytes=8 << 20)
    a, b = image(5), image(6)
    out_a = check(vlm, llm, [user(img_part(a), "describe the image in one word.")], [a])
    first_image = out_a.prompt_token_ids.index(llm.engine.media.vision.image_token_id)
    out_b = check(vlm, llm, [user(img_part(b), "describe the image in one word.")], [b])
    assert out_b.num_cached_tokens <= first_image  # same tokens, another image: no block with it hits
    out_a2 = check(vlm, llm, [user(img_part(a), "describe the image in one word.")], [a])
    assert out_a2.num_cached_tokens > first_image + IMAGE_TOKENS
    runs = encoder(llm)["encoder_runs"]
    assert runs == 2
    # the KV evicted: the encoder cache still saves the encoder run
    llm.reset_prefix_cache()
    hits = encoder(llm)["encoder_cache_hits"]
    out_a3 = check(vlm, llm, [user(img_part(a), "describe the image in one word.")], [a])
    assert out_a3.num_cached_tokens == 0
    assert encoder(llm)["encoder_runs"] == runs and encoder(llm)["encoder_cache_hits"] == hits + 1
    # another tenant: neither the KV nor the encoding is shared
    out_t = check(vlm, llm, [user(img_part(a), "describe the image in one word.")], [a], salt="tenant-b")
    assert out_t.num_cached_tokens == 0 and encoder(llm)["encoder_runs"] == runs + 1


def test_bad_images_are_refused_by_name(vlm, llm):
    vl = LLM(model=str(vlm[0]), block_size=BLOCK, kv_cache_memory_bytes=8 << 20, limit_images_per_prompt=2)
    sp = SamplingParams(max_tokens=2)
    cases = [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "messages[0].content[0]"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "remote image URLs"),
        ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}, "data:image/"),
        ({"type": "video", "video": "x"}, "messages[0].content[0] must be"),
    ]
    for part, words in cases:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            vl.chat([user(part, "hi")], sp, use_tqdm=False)
    buf = io.BytesIO()
    image(0).save(buf, format="TIFF")
    with pytest.raises(ValueError, match="format 'TIFF' is not supported"):
        vl.chat([user({"type": "image", "image": buf.getvalue()}, "hi")], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="at most 2 per prompt"):
        vl.chat([user(*[img_part(image(i)) for i in range(3)])], sp, use_tqdm=False)
    small = LLM(model=str(vlm[0]), block_size=BLOCK, kv_cache_memory_bytes=8 << 20, max_image_pixels=1000)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: the image is 50x40 pixels"):
        small.chat([user(img_part(image(0)), "hi")], sp, use_tqdm=False)
    ids = vl.chat_token_ids([user(img_part(image(0)), "hi")])
    with pytest.raises(ValueError, match="holds image tokens but no multi_modal_data"):
        vl.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)
    with pytest.raises(ValueError, match="holds 1 image"):
        vl.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [image(0), image(1)]}}, sp,
                    use_tqdm=False)
    assert vl.engine.scheduler.num_waiting() == 0 and not vl.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="this model takes no images"):  # the default (text) model
        llm.chat([user(img_part(image(0)), "hi")], sp, use_tqdm=False)


def test_text_prompt_with_multi_modal_data(vlm):
    """vLLM's form: a text prompt with ``<start_of_image>`` where each image goes."""
    llm = LLM(model=str(vlm[0]), block_size=BLOCK, kv_cache_memory_bytes=8 << 20)
    _, proc, hf = vlm
    a = image(7)
    text = "<bos>describe <start_of_image> in one word."
    inputs = proc(text=text, images=[a], return_tensors="pt")
    ref = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": a}},
                       SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == ref.tolist()


def test_planner_counts_the_encoder_and_each_images_tokens(vlm):
    """``kvos plan`` on the same folder: the encoder's parameters are the engine's (tower and
    projector), and an image adds to a prompt what the engine's prompt holds for it, within one
    token (the blank lines around an image may merge with the text beside them)."""
    from kvos.sim.hardware import resolve_gpu
    from kvos.sim.planner import PlanInput, plan
    from kvos.sim.shapes import resolve_shape

    llm = LLM(model=str(vlm[0]), block_size=BLOCK, kv_cache_memory_bytes=8 << 20)
    model = llm.engine.runner.model
    encoder = sum(p.numel() for m in (model.vision_tower, model.multi_modal_projector) for p in m.parameters())
    shape = resolve_shape(str(vlm[0]))
    r = plan(PlanInput(shape, resolve_gpu("H200"), context_len=100, images_per_request=2))
    assert r["vision_params"] == encoder
    text = llm.chat_token_ids([user("describe the image in one word.", "what is in this picture?")])
    with_images = llm.chat_token_ids([user("describe the image in one word.", img_part(image(0)),
                                           "what is in this picture?", img_part(image(1)))])
    assert abs(r["image_tokens_per_request"] - (len(with_images) - len(text))) <= 2
    assert r["context_len"] == 100 + r["image_tokens_per_request"]
    assert r["image_tokens_per_request"] == 2 * (IMAGE_TOKENS + 4)


def test_encodings_and_kv_trade_the_pools_pages(vlm):
    """Encodings live in pages of the KV pool: a prompt that needs the whole pool takes their
    pages (evicted), and the image then runs through the encoder again, with the same answer."""
    llm = LLM(model=str(vlm[0]), block_size=BLOCK, num_blocks=24, enable_prefix_caching=True)
    a = image(8)
    messages = [user(img_part(a), "what is in this picture?")]
    check(vlm, llm, messages, [a])
    assert encoder(llm)["encoder_cache_pages"] >= 1 and encoder(llm)["encoder_runs"] == 1
    assert llm.stats()["used"] == 0  # an encoding is cached content, not a running request's
    kv = llm.engine.kv
    longest = kv.capacity_tokens(llm.engine.config.max_num_batched_tokens) - 1
    text = torch.randint(10, 300, (longest,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate({"prompt_token_ids": text}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1  # it ran: every page was free or freed for it
    assert encoder(llm)["encoder_cache_evictions"] == 1 and encoder(llm)["encoder_cache_pages"] == 0
    llm.reset_prefix_cache()
    check(vlm, llm, messages, [a])
    assert encoder(llm)["encoder_runs"] == 2
