"""Encoder engines (E/PD) through a real ``kvos serve --encoder-engines 1`` of a tiled
vision-language model (the tiny random Idefics3 checkpoint) and the official openai client: the
image's tiles are encoded on the encoder engine, the language engine receives the encodings and
never runs its encoder, the answer is transformers' own; a later turn with the same image sends
no work to the encoder engine (the front end knows the language engine holds it), and a new
image goes to the encoder engine again (the metrics say so)."""
from __future__ import annotations

import openai
import pytest

from tests.models.test_idefics3 import hf_reference, image
from tests.models.test_vision_language import png_data_url
from tests.support.server import Server


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    import torch
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    from tests.support.vlm_checkpoints import write_idefics3_checkpoint

    path = write_idefics3_checkpoint(tmp_path_factory.mktemp("idefics3-epd"))
    hf = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, AutoProcessor.from_pretrained(path), hf


def test_encoder_engine_encodes_and_the_language_engine_answers_as_transformers(idefics3):
    from tests.models.test_idefics3 import NEW_TOKENS

    path, proc, _ = idefics3
    s = Server("--model", str(path), "--block-size", "4", "--kv-cache-memory-bytes", str(16 << 20),
               "--encoder-engines", "1", "--transport", "process", "--generation-config", "kvos").wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        tok = proc.tokenizer

        def ask(msgs):
            return client.chat.completions.create(model=path.name, messages=msgs, max_tokens=NEW_TOKENS,
                                                  temperature=0, extra_body={"ignore_eos": True})

        def part(img):
            return {"type": "image_url", "image_url": {"url": png_data_url(img)}}

        square = image(0)
        first = [{"role": "user", "content": [part(square), {"type": "text", "text": "what is in this picture?"}]}]
        out = ask(first)
        ref = hf_reference(idefics3, [{"role": "user", "content": [{"type": "image", "image": square},
                                                                   {"type": "text", "text": "what is in this picture?"}]}],
                           [square])
        assert out.usage.prompt_tokens == len(ref[0])
        assert out.choices[0].message.content == tok.decode(ref[1], skip_special_tokens=True)
        assert s.metric("kvos:encoder_engine_runs_total") == 10  # 3 x 3 tiles and the global view
        assert s.metric("kvos:encodings_received_total") == 10
        assert s.metric("kvos:encoder_runs_total") == 0  # the language engine never ran its encoder
        later = first + [{"role": "assistant", "content": out.choices[0].message.content},
                         {"role": "user", "content": [{"type": "text", "text": "and this one?"}, part(image(1, (20, 60)))]}]
        again = ask(later)
        assert again.usage.prompt_tokens_details.cached_tokens >= out.usage.prompt_tokens - 4
        assert s.metric("kvos:encoder_engine_runs_total") == 14  # only the new image's 1 x 3 tiles + global
        assert s.metric("kvos:encoder_runs_total") == 0
    finally:
        s.stop()
