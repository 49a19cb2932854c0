"""Encoder engines (E/PD) through a real ``kvos serve --encoder-engines 1`` of a tiled
vision-language model (the tiny random Idefics3 checkpoint) and the official openai client: the
image's tiles are encoded on the encoder engine, the language engines receive the encodings and
never run their encoders, the answers are transformers' own; a request with an image an engine
already holds goes there (image-aware routing) and sends no work to the encoder engine."""
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


def test_encoder_engine_encodes_and_the_language_engines_answer_as_transformers(idefics3):
    """Two language engines behind a round-robin router and one encoder engine: the first
    image's tiles are encoded on the encoder engine only; a second request with the same image
    (another question) is sent, against the round robin, to the engine holding its encodings,
    where it hits the prefix cache and nothing is encoded; a new image is encoded there again."""
    from tests.models.test_idefics3 import NEW_TOKENS

    path, proc, _ = idefics3
    s = Server("--model", str(path), "--block-size", "4", "--kv-cache-memory-bytes", str(16 << 20),
               "--data-parallel", "2", "--router", "round_robin", "--encoder-engines", "1", "--transport", "process",
               "--generation-config", "kvos").wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        tok = proc.tokenizer

        def check(img, text):
            out = client.chat.completions.create(
                model=path.name, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(img)}},
                                                       {"type": "text", "text": text}]}])
            ids, tokens, _ = hf_reference(idefics3, [{"role": "user", "content": [
                {"type": "image", "image": img}, {"type": "text", "text": text}]}], [img])
            assert out.usage.prompt_tokens == len(ids)
            assert out.choices[0].message.content == tok.decode(tokens, skip_special_tokens=True)
            return out

        square = image(0)
        check(square, "what is in this picture?")
        assert s.metric("kvos:encoder_engine_runs_total") == 10  # 3 x 3 tiles and the global view
        assert s.metric("kvos:encodings_received_total") == 10
        again = check(square, "describe the image in one word.")
        assert s.metric("kvos:router_encoder_routed_total") == 1  # round robin said the other engine
        assert again.usage.prompt_tokens_details.cached_tokens > 10 * 16  # its tiles' KV hit there
        assert s.metric("kvos:encoder_engine_runs_total") == 10
        check(image(1, (20, 60)), "and this one?")
        assert s.metric("kvos:encoder_engine_runs_total") == 14  # 1 x 3 tiles and the global view
        assert s.metric("kvos:encoder_runs_total") == 0  # no language engine ran its encoder
    finally:
        s.stop()
