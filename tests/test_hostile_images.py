"""Valid-but-hostile images (a decompression bomb, a huge palette, a truncated PNG, animated frames) are
refused with a ConfigError or read as their first frame, never an unexpected exception; the pixel limit is
PIL's own setting; the processed-image cache is bounded by bytes."""

import base64
import io
import struct
import zlib

import pytest
import torch
from PIL import Image

from instar.config import ConfigError
from instar.data import images
from instar.data.images import Vision, data_url, load_image


def png(image: Image.Image, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, **{"format": "PNG", **save})
    return out.getvalue()


def with_palette(size: int) -> bytes:
    """An 8x8 palette PNG whose PLTE chunk is ``size`` bytes (a valid one holds at most 768)."""
    raw = png(Image.new("P", (8, 8)))
    at = raw.index(b"PLTE") - 4
    end = at + 12 + struct.unpack(">I", raw[at:at + 4])[0]
    chunk = b"PLTE" + bytes(range(256)) * (size // 256)
    return raw[:at] + struct.pack(">I", size) + chunk + struct.pack(">I", zlib.crc32(chunk)) + raw[end:]


def frames(fmt: str) -> bytes:
    """64x64 frames, frame k red k, animated."""
    reds = [Image.new("RGB", (64, 64), (k, 0, 0)) for k in range(1, 51)]
    return png(reds[0], format=fmt, save_all=True, append_images=reds[1:])


# name: (the image file, None when it must be refused, else its size and first pixel)
HOSTILE = {
    "bomb": (lambda: png(Image.new("1", (14000, 14000))), None),  # 24 KB; PIL raises past 2x its limit
    "over the limit": (lambda: png(Image.new("1", (10000, 10000))), None),  # PIL only warns here
    "huge palette": (lambda: with_palette(2**20), None),
    "truncated": (lambda: png(Image.effect_noise((64, 64), 50).convert("RGB"))[:60], None),
    "apng": (lambda: frames("PNG"), ((64, 64), (1, 0, 0))),
    "gif": (lambda: frames("GIF"), ((64, 64), (1, 0, 0))),
}


def url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_images_are_refused_or_read_as_their_first_frame(name):
    make, expected = HOSTILE[name]
    if expected is None:
        with pytest.raises(ConfigError, match=r"^image: not a readable image \("):
            load_image(url(make()))
        with pytest.raises(ConfigError, match="^record 3: not a readable image"):
            data_url(make(), where="record 3")
    else:
        image = load_image(url(make()))
        assert (image.mode, image.size, image.getpixel((0, 0))) == ("RGB", *expected)


def test_the_pixel_limit_is_pils_setting(monkeypatch):
    raw = png(Image.new("RGB", (64, 48)))
    assert load_image(url(raw)).size == (64, 48)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 48 - 1)
    with pytest.raises(ConfigError, match=r"64x48 pixels is over PIL.Image.MAX_IMAGE_PIXELS, 3071\)$"):
        load_image(url(raw))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # PIL's way to switch its check off
    assert load_image(url(raw)).size == (64, 48)


def test_the_processed_image_cache_is_bounded_by_bytes_least_recently_used_out(monkeypatch):
    calls = []

    def processor(images, return_tensors):
        calls.append(images[0].size)
        side = images[0].size[0]
        return {"pixel_values": torch.zeros(side, 256), "image_grid_thw": torch.tensor([[1, 2, 2]])}

    urls = {side: data_url(Image.new("RGB", (side, 2))) for side in (1, 2, 3)}
    size = {side: len(u) + side * 256 * 4 for side, u in urls.items()}  # the URL and its float32 patches
    monkeypatch.setattr(images, "CACHE_BYTES", size[1] + size[2] + size[3] - 1)
    vision = Vision(processor, token_id=7, merge=1)
    for side in (1, 2, 1, 3):  # 1 is used again after 2, so 2 is the least recently used when 3 comes
        vision.encode(urls[side])
    assert list(vision.cache) == [urls[1], urls[3]] and calls == [(1, 2), (2, 2), (3, 2)]
    assert vision.encode(urls[2]).pixel_values.shape == (2, 256) and list(vision.cache) == [urls[3], urls[2]]
