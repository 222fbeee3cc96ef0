"""Images for vision-language models, in one form everywhere: a chat content part
``{"type": "image", "image": "data:image/png;base64,..."}``. Datasets (paths, base64), the OpenAI
``image_url`` and Anthropic ``image`` parts and an Env's images all become that, so a conversation stays
plain JSON (hashable, cacheable, sent between processes as text) and one image is one string.

`Vision` renders them for the model: the image processor turns each into patches (`ImageInputs`) and
the single placeholder token the chat template writes per image is expanded to one token per merged
patch, so the token ids the engine samples after and the trainer trains on hold the image exactly.
"""

from __future__ import annotations

import base64
import io
import threading
from pathlib import Path
from typing import Any

import torch

from instar.config import ConfigError
from instar.contract import ContractError, ImageInputs
from instar.data.chat import Message

# processed images kept per process, counting their data URLs and patches: a group's samples and a session's
# turns share them
CACHE_BYTES = 2**31


def data_url(image: Any, base_dir: str | Path | None = None, where: str = "image") -> str:
    """An image as a PNG data URL: a PIL image, raw bytes, a data URL, bare base64, or a file path
    (relative to ``base_dir``). Anything unreadable is a `ConfigError` naming ``where``."""
    if isinstance(image, str) and image.startswith("data:"):
        return image
    if isinstance(image, dict):  # a `datasets` Image column's record
        image = image.get("bytes") or image.get("path") or image
    if isinstance(image, str):  # a file, else base64
        path = Path(base_dir or ".") / image
        is_file = len(image) < 4096 and path.is_file()
        image = path.read_bytes() if is_file else _base64(
            image, f"{where}: {image[:80]!r} is neither a file (looked in {path.parent}) nor base64 image data")
    if isinstance(image, (bytes, bytearray)):
        image = _open(bytes(image), where)
    if hasattr(image, "save") and hasattr(image, "mode"):  # a PIL image
        return _png_url(image)
    raise ConfigError(f"{where}: an image must be a PIL image, bytes, a data URL, base64 or a file path, "
                      f"got {type(image).__name__}")


def load_image(url: str, where: str = "image") -> Any:
    """The PIL image (RGB) of a data URL; see `_open` for what is refused."""
    head, _, payload = url.partition(",")
    if not head.startswith("data:") or not payload:
        raise ConfigError(f"{where}: expected a data URL (data:image/...;base64,...), got {url[:60]!r}")
    return _open(_base64(payload, f"{where}: the data URL's payload is not base64"), where)


def _base64(text: str, error: str) -> bytes:
    """The bytes ``text`` encodes; a `ConfigError` saying ``error`` when it is not base64."""
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error is a ValueError
        raise ConfigError(error) from None


def _open(raw: bytes, where: str) -> Any:
    """The RGB image (an animation's first frame) of ``raw``; a `ConfigError` when it is no image or has more
    pixels than ``PIL.Image.MAX_IMAGE_PIXELS`` (PIL's own setting; it only warns up to twice that)."""
    from PIL import Image
    try:
        image = Image.open(io.BytesIO(raw))  # reads the header only
        if Image.MAX_IMAGE_PIXELS and image.width * image.height > Image.MAX_IMAGE_PIXELS:
            raise Image.DecompressionBombError(f"{image.width}x{image.height} pixels is over "
                                               f"PIL.Image.MAX_IMAGE_PIXELS, {Image.MAX_IMAGE_PIXELS}")
        return image.convert("RGB")
    except Exception as e:  # PIL's decoders fail on hostile input in many types (OSError, ValueError, ...)
        raise ConfigError(f"{where}: not a readable image ({e})") from None


def _png_url(image: Any) -> str:
    out = io.BytesIO()
    image.convert("RGB").save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image_part(image: Any, base_dir: str | Path | None = None, where: str = "image") -> dict:
    return {"type": "image", "image": data_url(image, base_dir, where)}


def normalise(messages: list[Message], base_dir: str | Path | None = None, where: str = "prompt") -> list[Message]:
    """``messages`` with every image part in the one form (``image`` or ``image_url`` parts, any source
    `data_url` reads); messages without images come back as they are."""
    out = []
    for k, message in enumerate(messages):
        if isinstance(content := message.get("content"), list) and any(_is_image(p) for p in content):
            parts = [image_part(_source(p), base_dir, f"{where} message {k} part {i}") if _is_image(p) else p
                     for i, p in enumerate(content)]
            message = {**message, "content": parts}
        out.append(message)
    return out


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def _source(part: dict) -> Any:
    value = part.get(part["type"]) or part.get("url") or part.get("path")
    return value.get("url") if isinstance(value, dict) else value  # OpenAI: {"image_url": {"url": ...}}


def with_images(text: str, images: list[Any] | None, where: str = "observation") -> str | list[dict]:
    """A message content: ``text`` alone, or the images (any `data_url` source) then the text."""
    if not images:
        return text
    parts = [image_part(im, where=f"{where} image {k}") for k, im in enumerate(images)]
    return [*parts, {"type": "text", "text": text}]


def with_markers(content: str | list[dict], images: list[str]) -> list[dict]:
    """A user turn's content with ``images`` (data URLs) at its ``<image>`` markers (geo3k's form), or
    before it when the text has no marker for each."""
    parts = text_of(content).split("<image>")
    if len(parts) != len(images) + 1:
        return [image_part(im) for im in images] + (content if isinstance(content, list) else
                                                     [{"type": "text", "text": content}])
    out = [{"type": "text", "text": parts[0]}]
    for im, rest in zip(images, parts[1:]):
        out += [image_part(im), {"type": "text", "text": rest}]
    return [p for p in out if p.get("type") != "text" or p["text"]]


def text_of(content: Any) -> str:
    """The text of a message content (its text parts, when it has images)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content or ""


def image_urls(messages: list[Message]) -> list[str]:
    """The data URLs of the image parts of (normalised) ``messages``, in order."""
    return [p["image"] for m in messages if isinstance(m.get("content"), list) for p in m["content"] if _is_image(p)]


class Vision:
    """What a vision-language checkpoint needs to see images: its image processor and placeholder token."""

    def __init__(self, processor: Any, token_id: int, merge: int) -> None:
        self.processor, self.token_id, self.merge = processor, token_id, merge
        self.cache, self.lock = {}, threading.Lock()  # patches by data URL, the least recently used first

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Vision | None:
        """The checkpoint's vision, or None for a text-only model."""
        from transformers import AutoConfig, AutoImageProcessor
        config = AutoConfig.from_pretrained(str(path))
        if getattr(config, "vision_config", None) is None:
            return None
        if not (Path(path) / "preprocessor_config.json").is_file():
            raise ConfigError(f"{path} is a vision-language model without preprocessor_config.json (its image "
                              "processor)")
        return cls(AutoImageProcessor.from_pretrained(str(path)), config.image_token_id,
                   config.vision_config.spatial_merge_size)

    def encode(self, url: str) -> ImageInputs:
        """One image's patches, cached (`CACHE_BYTES`). Thread-safe: the chat server encodes off its event loop."""
        with self.lock:
            if url in self.cache:
                self.cache[url] = self.cache.pop(url)
                return self.cache[url]
        out = self.processor(images=[load_image(url)], return_tensors="pt")
        image = ImageInputs(out["pixel_values"].float(), out["image_grid_thw"].long(), self.token_id, self.merge)
        with self.lock:
            self.cache[url] = image
            while sum(len(u) + im.pixel_values.nbytes for u, im in self.cache.items()) > CACHE_BYTES:
                del self.cache[next(iter(self.cache))]
        return image

    def expand(self, ids: list[int], urls: list[str]) -> tuple[list[int], list[ImageInputs]]:
        """``ids`` as the chat template wrote them (one placeholder per image) with each placeholder
        repeated once per merged patch of its image, and the images' inputs."""
        images = [self.encode(u) for u in urls]
        if (slots := ids.count(self.token_id)) != len(images):
            raise ContractError(f"the chat template wrote {slots} image placeholders for {len(images)} images")
        counts = iter(image.counts[0] for image in images)
        return [t for t in ids for _ in range(next(counts) if t == self.token_id else 1)], images

    def pictures(self, images: ImageInputs) -> list[Any]:
        """The images back as PIL pictures, as the model sees them (resized), from their patches: the
        processor's layout undone (Qwen-VL: each row one patch of (channels, time, patch, patch), rows in
        merge-window order) and its normalisation reversed. For looking at a dump (`instar view`)."""
        from PIL import Image
        p, m = self.processor.patch_size, self.merge
        mean, std = (torch.tensor(v).view(-1, 1, 1) for v in (self.processor.image_mean, self.processor.image_std))
        out = []
        for one in images.split():
            _, gh, gw = one.grid_thw[0].tolist()
            x = one.pixel_values.view(gh // m, gw // m, m, m, len(mean), -1, p, p)[:, :, :, :, :, 0]
            x = x.permute(4, 0, 2, 5, 1, 3, 6).reshape(len(mean), gh * p, gw * p)
            x = (x * std + mean) / self.processor.rescale_factor
            out.append(Image.fromarray(x.round().clamp(0, 255).byte().permute(1, 2, 0).numpy()))
        return out
