"""Images from users to ``MediaItem``s: decoding (data URLs, bytes, PIL images, files; remote
URLs only when allowed), limits, the model's own image preprocessing (transformers' image
processor of the checkpoint), content keys, and the prompt's image tokens."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvos.core.media import MediaItem
from kvos.models.config import VisionShape

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class MediaLimits:
    """``max_images`` per prompt (``--limit-images-per-prompt``); ``max_pixels`` per decoded image
    (width x height, ``--max-image-pixels``); ``max_bytes`` of one encoded image;
    ``allow_remote``: http(s) URLs are fetched (``--allow-remote-images``; off: the server reaches
    no network); ``allow_files``: a path names a local file (Python callers, not the server)."""

    max_images: int = 8
    max_pixels: int = 40_000_000
    max_bytes: int = 20 << 20
    allow_remote: bool = False
    allow_files: bool = False
    remote_timeout_s: float = 10.0


def _decode(data: bytes, where: str, limits: MediaLimits):
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise ValueError(f"{where}: the image is {len(data)} bytes, more than {limits.max_bytes}")
    Image.MAX_IMAGE_PIXELS = None  # our own limit, below, with the field named
    try:
        img = Image.open(io.BytesIO(data))
        fmt = img.format
        if fmt not in IMAGE_FORMATS:
            raise ValueError(f"{where}: image format {fmt!r} is not supported ({', '.join(IMAGE_FORMATS)})")
        check_pixels(img, where, limits)
        img.load()
    except ValueError:
        raise
    except Exception as e:  # PIL's UnidentifiedImageError, truncated files, decoder errors
        raise ValueError(f"{where}: not a readable image ({type(e).__name__}: {str(e)[:200]})") from None
    return img


def check_pixels(img, where: str, limits: MediaLimits) -> None:
    w, h = img.size
    if w * h > limits.max_pixels:
        raise ValueError(f"{where}: the image is {w}x{h} pixels, more than {limits.max_pixels}")
    if w < 1 or h < 1:
        raise ValueError(f"{where}: the image is empty ({w}x{h})")


def load_image(source, where: str, limits: MediaLimits):
    """A PIL image from ``source``: a PIL image, bytes, a ``data:image/...;base64,`` URL, an
    http(s) URL (``limits.allow_remote``) or a path (``limits.allow_files``). ``ValueError`` naming
    ``where`` for anything else, a corrupt or unsupported image, or one past the limits."""
    from PIL import Image

    if isinstance(source, Image.Image):
        check_pixels(source, where, limits)
        return source
    if isinstance(source, (bytes, bytearray)):
        return _decode(bytes(source), where, limits)
    if isinstance(source, Path) or (isinstance(source, str) and limits.allow_files and not source.startswith(
            ("data:", "http://", "https://"))):
        if not limits.allow_files:
            raise ValueError(f"{where}: local files are not read here")
        try:
            return _decode(Path(source).read_bytes(), where, limits)
        except OSError as e:
            raise ValueError(f"{where}: cannot read {str(source)!r} ({e.strerror})") from None
    if not isinstance(source, str):
        raise ValueError(f"{where}: an image must be a data URL, bytes or a PIL image, got {type(source).__name__}")
    if source.startswith("data:"):
        head, sep, payload = source.partition(",")
        if not sep or not head.endswith(";base64") or not head[5:].startswith("image/"):
            raise ValueError(f"{where}: a data URL must look like data:image/<format>;base64,<data>")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: the data URL's base64 payload is invalid") from None
        return _decode(data, where, limits)
    if source.startswith(("http://", "https://")):
        if not limits.allow_remote:
            raise ValueError(f"{where}: remote image URLs are not fetched by this server (send the image as a "
                             f"data:image/...;base64 URL, or start it with --allow-remote-images)")
        try:
            with urllib.request.urlopen(source, timeout=limits.remote_timeout_s) as r:  # noqa: S310 (http(s) only)
                data = r.read(limits.max_bytes + 1)
        except Exception as e:
            raise ValueError(f"{where}: cannot fetch the image ({type(e).__name__}: {str(e)[:200]})") from None
        return _decode(data, where, limits)
    raise ValueError(f"{where}: an image URL must be a data: URL"
                     + (" or an http(s) URL" if limits.allow_remote else ""))


def content_hash(img) -> str:
    """The decoded image's identity: its mode, size and pixels (not its file's bytes)."""
    h = hashlib.blake2b(digest_size=16, person=b"kvos-image")
    h.update(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
    h.update(img.tobytes())
    return h.hexdigest()


def salted_key(content: str, cache_salt: str | None) -> str:
    """The encoder cache's and the block hashes' key: the content hash within one tenant."""
    h = hashlib.blake2b(digest_size=16, person=b"kvos-media")
    h.update(content.encode())
    h.update(b"\x00")
    h.update((cache_salt or "").encode("utf-8", "surrogatepass"))
    return h.hexdigest()


@dataclass(frozen=True)
class PreparedImage:
    """An image decoded and preprocessed once: its content hash and the encoder's input."""

    content: str
    pixels: np.ndarray


class ImagePreparer:
    """The checkpoint's own image preprocessing (transformers' image processor read from its
    folder, the same as its processor applies) or, for a random-weight config, Gemma 3's
    (resize to ``image_size``, rescale, normalise to [-1, 1])."""

    def __init__(self, vision: VisionShape, folder: Path | None, limits: MediaLimits) -> None:
        self.vision = vision
        self.limits = limits
        self.folder = folder
        self._processor = None  # built on the first image (a text-only run never imports it)

    def prepare(self, source, where: str) -> PreparedImage:
        """``source`` decoded (``load_image``) and preprocessed; a ``PreparedImage`` as it is."""
        if isinstance(source, PreparedImage):
            return source
        img = load_image(source, where, self.limits)
        rgb = img.convert("RGB")
        if self._processor is None:
            self._processor = _image_processor(self.vision, self.folder)
        pixels = self._processor(images=[rgb], return_tensors="np")["pixel_values"][0]
        return PreparedImage(content_hash(rgb), np.ascontiguousarray(pixels, dtype=np.float32))


    def prepare_all(self, data, names: list[str] | None = None) -> list[PreparedImage]:
        """``multi_modal_data``'s images (``{"image": an image or a list}``) prepared in order;
        ValueError naming ``multi_modal_data.image[i]`` (or ``names[i]``) for a bad one, or
        past ``limits.max_images`` (``limit_images_per_prompt``)."""
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data must be a dict {'image': an image or a list of images}")
        images = data.get("image") or []
        images = images if isinstance(images, (list, tuple)) else [images]
        if len(images) > self.limits.max_images:
            raise ValueError(f"multi_modal_data.image: {len(images)} images; at most {self.limits.max_images} "
                             f"per prompt (limit_images_per_prompt)")
        names = names or [f"multi_modal_data.image[{i}]" for i in range(len(images))]
        return [self.prepare(im, where) for im, where in zip(images, names)]


def _image_processor(vision: VisionShape, folder: Path | None):
    import transformers

    size = {"height": vision.image_size, "width": vision.image_size}
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = folder / name if folder is not None else None
        if path is not None and path.exists():
            cfg = json.loads(path.read_text())
            cfg = cfg.get("image_processor", cfg)
            cls_name = cfg.get("image_processor_type", "Gemma3ImageProcessor")
            cls = getattr(transformers, cls_name + "Pil", None) or getattr(transformers, cls_name)
            keep = {k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")}
            return cls(**keep)
    return transformers.Gemma3ImageProcessorPil(size=size)


def image_sequence_text(tokenizer, vision: VisionShape) -> str:
    """What one image's ``<start_of_image>`` becomes in the prompt text (Gemma 3's processor):
    a blank line, the start token, ``tokens_per_image`` image tokens, the end token, a blank line."""
    boi, img, eoi = tokenizer.convert_ids_to_tokens([vision.boi_token_id, vision.image_token_id,
                                                     vision.eoi_token_id])
    return f"\n\n{boi}{img * vision.tokens_per_image}{eoi}\n\n"


def expand_image_text(text: str, tokenizer, vision: VisionShape) -> str:
    """``text`` with every start-of-image token's text replaced by the image's whole sequence."""
    boi = tokenizer.convert_ids_to_tokens(vision.boi_token_id)
    return text.replace(boi, image_sequence_text(tokenizer, vision))


def image_spans(ids: Sequence[int], vision: VisionShape) -> list[tuple[int, int]]:
    """The runs of image tokens in ``ids``: ``[start, end)`` each."""
    spans, start = [], None
    tok = vision.image_token_id
    for i, t in enumerate(ids):
        if t == tok and start is None:
            start = i
        elif t != tok and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(ids)))
    return spans


def media_items(ids: Sequence[int], images: Sequence[PreparedImage], vision: VisionShape,
                cache_salt: str | None) -> tuple[MediaItem, ...]:
    """Pair the prompt's image-token runs with ``images`` in order. ``ValueError`` naming
    ``multi_modal_data`` when the counts or a run's length do not match."""
    spans = image_spans(ids, vision)
    if len(spans) != len(images):
        raise ValueError(f"multi_modal_data: the prompt holds {len(spans)} image(s) (runs of image token "
                         f"{vision.image_token_id}) and {len(images)} were given")
    for s, e in spans:
        if e - s != vision.tokens_per_image:
            raise ValueError(f"multi_modal_data: an image takes {vision.tokens_per_image} image tokens; the prompt "
                             f"has a run of {e - s} at position {s}")
    return tuple(MediaItem(s, e - s, salted_key(im.content, cache_salt), im.pixels)
                 for (s, e), im in zip(spans, images))
