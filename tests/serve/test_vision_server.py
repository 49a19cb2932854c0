"""Images through a real ``kvos serve`` of a vision-language model (the tiny random Gemma 3
checkpoint) and the official openai client: an image as a data URL answers as transformers
does, a later request with the same image hits the cache without running the encoder (the
metrics say so), and bad images are 400s naming the part."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.models.test_vision_language import image, png_data_url
from tests.support.server import Server
from tests.support.vlm_checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gemma3-vlm-server"))


@pytest.fixture(scope="module")
def server(folder):
    s = Server("--model", str(folder), "--block-size", "4", "--kv-cache-memory-bytes", str(8 << 20),
               "--limit-images-per-prompt", "2", "--generation-config", "kvos").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def messages(url: str, text: str = "what is in this picture?"):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


@torch.inference_mode()
def test_image_chat_matches_transformers_and_hits_later(client, server, folder):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    proc = AutoProcessor.from_pretrained(folder)
    hf = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    img = image(11)
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {
        "type": "text", "text": "what is in this picture?"}]}], add_generation_prompt=True)
    inputs = proc(text=text, images=[img], return_tensors="pt")
    ref = hf.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    first = client.chat.completions.create(model=folder.name, messages=messages(png_data_url(img)), max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert first.choices[0].message.content == proc.tokenizer.decode(ref, skip_special_tokens=True)
    assert first.usage.prompt_tokens == inputs["input_ids"].shape[1]
    assert server.metric("kvos:encoder_runs_total") == 1
    again = client.chat.completions.create(model=folder.name, messages=messages(png_data_url(img)), max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > inputs["input_ids"][0].tolist().index(
        proc.tokenizer.convert_tokens_to_ids("<image_soft_token>"))
    assert server.metric("kvos:encoder_runs_total") == 1
    other = client.chat.completions.create(model=folder.name, messages=messages(png_data_url(image(12))),
                                           max_tokens=2, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    assert server.metric("kvos:encoder_runs_total") == 2
    assert server.metric("kvos:encoder_cache_bytes") > 0


@pytest.mark.parametrize("content, words", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "not a readable image"),
    ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "--allow-remote-images"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}], "base64"),
    ([{"type": "image_url", "image_url": {"url": "data:,"}}] * 3, "at most 2 images"),
    ([{"type": "image_url", "image_url": {"url": "/etc/hostname"}}], "must be a data: URL"),  # no server files
])
def test_bad_images_are_400s_naming_the_part(server, folder, content, words):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": folder.name, "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"]
    assert err["param"].startswith("messages[0].content[")


def test_data_parallel_engines_follow_each_image_to_its_engine(folder):
    """Two engine processes behind the KV-aware router: two chats with different images start
    at once (spread over both engines); each later turn returns to the engine holding its image's
    KV, because the front end hashes image keys into the blocks as the engines do (the text
    before the images is the same, so by text alone both engines would look alike)."""
    s = Server("--model", str(folder), "--block-size", "4", "--kv-cache-memory-bytes", str(8 << 20),
               "--data-parallel", "2", "--transport", "process", "--generation-config", "kvos").wait_ready()
    try:
        import concurrent.futures

        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        urls = [png_data_url(image(21)), png_data_url(image(22))]

        def ask(msgs):
            return client.chat.completions.create(model=folder.name, messages=msgs, max_tokens=4, temperature=0)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            firsts = list(pool.map(ask, [messages(u) for u in urls]))
        for url, first in zip(urls, firsts):
            later = messages(url) + [{"role": "assistant", "content": first.choices[0].message.content},
                                     {"role": "user", "content": "and the colours?"}]
            again = ask(later)
            assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 4
        assert s.metric("kvos:encoder_runs_total") == 2  # each image encoded once, on its engine
    finally:
        s.stop()
