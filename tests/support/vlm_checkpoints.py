"""A tiny random-weight Gemma 3 vision-language checkpoint (SigLIP tower, projector, text model),
with a small byte-level tokenizer, a Gemma-style chat template and the processor, written with
transformers and ``tokenizers``."""
from __future__ import annotations

from pathlib import Path

import torch

IMAGE_SIZE = 28
PATCH = 7
IMAGE_TOKENS = 4
"""Soft tokens per image: 4 x 4 patches pooled 2 x 2."""
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<start_of_image>{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
            "<image_soft_token>"]
CORPUS = ("the quick brown fox jumps over the lazy dog. what is in this picture? a red square and a blue "
          "circle on a white page. describe the image in one word. compare these two images.\n\n") * 20


def bpe_tokenizer(folder: Path, corpus: str, vocab_size: int, specials: list[str], template: str, **tokens):
    """A byte-level BPE tokenizer trained on ``corpus`` with ``specials`` first, saved to
    ``folder`` with the chat ``template``; ``tokens``: ``PreTrainedTokenizerFast``'s special-token
    keywords."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)
    fast.chat_template = template
    fast.save_pretrained(folder)
    return fast


def write_tokenizer(folder: Path):
    return bpe_tokenizer(
        folder, CORPUS, 400, SPECIALS, CHAT_TEMPLATE, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])


def write_checkpoint(folder: Path) -> Path:
    """A seeded random ``Gemma3ForConditionalGeneration`` saved as an HF folder; returns it."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(folder)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                max_position_embeddings=1024, rope_theta=10000.0, rope_local_base_freq=1000.0,
                query_pre_attn_scalar=16, bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
                pad_token_id=ids["<pad>"])
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS,
                       image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
                       eoi_token_index=ids["<end_of_image>"])
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():  # a sharper model than the initializer's, so greedy ties are rare
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(4.0) if "norm" not in name else None
            if "norm" in name:
                p.normal_(0.0, 0.1)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tok, chat_template=CHAT_TEMPLATE, image_seq_length=IMAGE_TOKENS)
    processor.save_pretrained(folder)
    return folder


IDEFICS3_SIZE = 32
IDEFICS3_PATCH = 4
IDEFICS3_TOKENS = 16
"""Soft tokens per tile: 8 x 8 patches pixel-shuffled 2 x 2."""
IDEFICS3_TILES = 3
"""Tiles per side of the largest image (the processor's longest edge over the tile)."""
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}"
    "{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}"
    "{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
"""SmolVLM's chat template (transformers' default for its processor)."""
IDEFICS3_SPECIALS = (["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                      "<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])


def write_idefics3_tokenizer(folder: Path):
    return bpe_tokenizer(
        folder, CORPUS + "User: Assistant: " * 20, 420, IDEFICS3_SPECIALS, IDEFICS3_TEMPLATE,
        bos_token="<|im_start|>", eos_token="<end_of_utterance>", pad_token="<|endoftext|>",
        additional_special_tokens=IDEFICS3_SPECIALS[2:])


def write_idefics3_checkpoint(folder: Path) -> Path:
    """A seeded random ``Idefics3ForConditionalGeneration`` (Llama text model) saved as an HF
    folder with its processor; returns the folder."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tok = write_idefics3_tokenizer(folder)
    ids = {t: tok.convert_tokens_to_ids(t) for t in IDEFICS3_SPECIALS}
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                rope_theta=10000.0, bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<end_of_utterance>"],
                pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IDEFICS3_SIZE, patch_size=IDEFICS3_PATCH)
    cfg = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2, image_token_id=ids["<image>"],
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(cfg)
    with torch.no_grad():  # a sharper model than the initializer's, so greedy ties are rare
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "norm" not in name:
                p.mul_(4.0)
            if "norm" in name:
                p.normal_(1.0, 0.1)
        model.model.connector.modality_projection.proj.weight.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(size={"longest_edge": IDEFICS3_TILES * IDEFICS3_SIZE},
                                                  max_image_size={"longest_edge": IDEFICS3_SIZE}),
        tokenizer=tok, chat_template=IDEFICS3_TEMPLATE, image_seq_len=IDEFICS3_TOKENS)
    processor.save_pretrained(folder)
    return folder
