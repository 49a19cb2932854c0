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
    """An image decoded and preprocessed once: its content hash and the encoder's inputs,
    ``tiles [n, 3, S, S]`` float32 (one for Gemma 3; Idefics3: ``rows x cols`` crops in row order,
    then the global view, or the global view alone when ``grid`` is ``(0, 0)``).
    ``encodings``: the tiles' encoder outputs ``[tokens_per_image, hidden]`` each, computed by an
    encoder engine; then ``tiles`` may be None (the pixels need not travel further)."""

    content: str
    tiles: np.ndarray | None
    grid: tuple[int, int] = (0, 0)
    encodings: tuple | None = None

    @property
    def num_tiles(self) -> int:
        return len(self.encodings) if self.tiles is None else len(self.tiles)

    def encoded(self, encodings: Sequence) -> PreparedImage:
        """This image with its tiles' encodings and without its pixels."""
        if len(encodings) != self.num_tiles:
            raise ValueError(f"{len(encodings)} encodings for an image of {self.num_tiles} tiles")
        return PreparedImage(self.content, None, self.grid, tuple(encodings))


class ImagePreparer:
    """The checkpoint's own image preprocessing (transformers' image processor read from its
    folder, the same as its processor applies) or, for a random-weight config, the family's
    defaults (Gemma 3: resize to ``image_size``, rescale, normalise to [-1, 1]; Idefics3:
    SmolVLM's tiling with ``max_tiles_per_side``)."""

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
        if self.vision.family == "idefics3":
            out = self._processor(images=[[rgb]], return_tensors="np", return_row_col_info=True)
            tiles, grid = out["pixel_values"][0], (int(out["rows"][0][0]), int(out["cols"][0][0]))
        else:
            tiles, grid = as_tiles(self._processor(images=[rgb], return_tensors="np")["pixel_values"][0]), (0, 0)
        size = self.vision.image_size
        if tiles.shape[1:] != (3, size, size):
            raise ValueError(f"{where}: the image processor made {tuple(tiles.shape[1:])} inputs; the encoder takes "
                             f"(3, {size}, {size}) (the processor's tile size must be vision_config.image_size)")
        return PreparedImage(content_hash(rgb), np.ascontiguousarray(tiles, dtype=np.float32), grid)

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


def as_tiles(pixels: np.ndarray) -> np.ndarray:
    """One image's ``[3, S, S]`` pixels as a stack of one tile."""
    return pixels[None] if pixels.ndim == 3 else pixels


def _image_processor(vision: VisionShape, folder: Path | None):
    import transformers

    for name in ("preprocessor_config.json", "processor_config.json"):
        path = folder / name if folder is not None else None
        if path is not None and path.exists():
            cfg = json.loads(path.read_text())
            cfg = cfg.get("image_processor", cfg)
            default = "Idefics3ImageProcessor" if vision.family == "idefics3" else "Gemma3ImageProcessor"
            cls_name = cfg.get("image_processor_type", default)
            cls = getattr(transformers, cls_name + "Pil", None) or getattr(transformers, cls_name)
            keep = {k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")}
            return cls(**keep)
    if vision.family == "idefics3":
        side = vision.image_size
        return transformers.Idefics3ImageProcessorPil(
            size={"longest_edge": side * vision.max_tiles_per_side}, max_image_size={"longest_edge": side})
    return transformers.Gemma3ImageProcessorPil(size={"height": vision.image_size, "width": vision.image_size})


IDEFICS3_FRAME, IDEFICS3_GLOBAL, IDEFICS3_IMAGE = "<fake_token_around_image>", "<global-img>", "<image>"


def image_sequence_text(tokenizer, vision: VisionShape, image: PreparedImage | None = None) -> str:
    """What one image's placeholder becomes in the prompt text, as the model's processor writes
    it. Gemma 3: a blank line, the start token, ``tokens_per_image`` image tokens, the end token,
    a blank line. Idefics3: per tile (row by row) a frame token, ``<row_r_col_c>`` and the tile's
    image tokens, a newline after each row; then a newline and the global view (frame,
    ``<global-img>``, image tokens, frame) — only the global view for an image not cut."""
    if vision.family == "idefics3":
        run = IDEFICS3_IMAGE * vision.tokens_per_image
        rows, cols = image.grid if image is not None else (0, 0)
        text = "".join("".join(f"{IDEFICS3_FRAME}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return text + ("\n" if rows or cols else "") + f"{IDEFICS3_FRAME}{IDEFICS3_GLOBAL}{run}{IDEFICS3_FRAME}"
    boi, img, eoi = tokenizer.convert_ids_to_tokens([vision.boi_token_id, vision.image_token_id,
                                                     vision.eoi_token_id])
    return f"\n\n{boi}{img * vision.tokens_per_image}{eoi}\n\n"


def expand_image_text(text: str, tokenizer, vision: VisionShape,
                      images: Sequence[PreparedImage] = ()) -> str:
    """``text`` with each image placeholder (Gemma 3's start-of-image token, Idefics3's
    ``<image>``) replaced by its image's whole sequence; Idefics3's depends on the image's
    tiles, so ``images`` are the prompt's, in order (ValueError naming ``multi_modal_data`` when
    the counts differ)."""
    if vision.family == "idefics3":
        parts = text.split(IDEFICS3_IMAGE)
        if len(parts) - 1 != len(images):
            raise ValueError(f"multi_modal_data: the prompt holds {len(parts) - 1} {IDEFICS3_IMAGE} placeholder(s) "
                             f"and {len(images)} image(s) were given")
        out = [parts[0]]
        for im, rest in zip(images, parts[1:]):
            out += [image_sequence_text(tokenizer, vision, im), rest]
        return "".join(out)
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
    """Pair the prompt's image-token runs with ``images``' tiles in order: one ``MediaItem``
    per tile, keyed by the image's salted key (and the tile's index when it has several).
    ``ValueError`` naming ``multi_modal_data`` when the counts or a run's length do not match."""
    spans = image_spans(ids, vision)
    tiles = [(tile_key(im, t, cache_salt), im.tiles[t] if im.tiles is not None else None,
              im.encodings[t] if im.encodings is not None else None)
             for im in images for t in range(im.num_tiles)]
    if len(spans) != len(tiles):
        raise ValueError(f"multi_modal_data: the prompt holds {len(spans)} image token run(s) (of token "
                         f"{vision.image_token_id}) and the {len(images)} image(s) given make {len(tiles)}")
    for s, e in spans:
        if e - s != vision.tokens_per_image:
            raise ValueError(f"multi_modal_data: an image takes {vision.tokens_per_image} image tokens; the prompt "
                             f"has a run of {e - s} at position {s}")
    return tuple(MediaItem(s, e - s, key, pixels, enc) for (s, e), (key, pixels, enc) in zip(spans, tiles))


def tile_key(image: PreparedImage, tile: int, cache_salt: str | None) -> str:
    """The encoder cache's key of one tile: the image's salted key (and the tile's index when
    the image has several)."""
    return salted_key(image.content, cache_salt) + (f"/{tile}" if image.num_tiles > 1 else "")
