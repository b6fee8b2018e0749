"""Images in `tiderl serve` requests (docs/serve.md, "What the API does"; docs/env_visual.md, "How
images flow"): `decode_data_url` turns an OpenAI image content part into an RGB PIL image (base64
data URLs only: the server fetches nothing; within `MAX_IMAGE_BYTES`, `MAX_IMAGE_SIDE` and
`MAX_IMAGES` a request); `takes_images` says whether a model reads them (the server answers 400
for any other); `image_prompt_ids` renders messages some of which hold images.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from typing import Any

from tiderl.envs.protocol import Observation
from tiderl.types import image_to_data_url as encode_data_url  # noqa: F401 - what a client sends, as tiderl writes it

MAX_IMAGES = 32  # images in one request (the whole conversation, as clients resend it)
MAX_IMAGE_BYTES = 8 * 1024 * 1024  # encoded bytes of one image
MAX_IMAGE_SIDE = 4096  # pixels of one image's longer side

_DATA_URL = re.compile(r"data:(image/[A-Za-z0-9.+-]+);base64,(.*)", re.DOTALL)


def decode_data_url(url: Any) -> Any:
    """The RGB PIL image a base64 `data:image/...` URL holds. ValueError saying what is wrong (not a
    data URL, not base64, too large, not an image) and what to send instead."""
    if not isinstance(url, str):
        raise ValueError(f"the image url must be a string, got {type(url).__name__}")
    match = _DATA_URL.fullmatch(url.strip())
    if match is None:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise ValueError(f"the image url {shown!r} is not a base64 data URL; tiderl serve fetches nothing: send the "
                         "image inline as data:image/png;base64,<bytes>")
    payload = match.group(2)
    if len(payload) * 3 // 4 > MAX_IMAGE_BYTES:
        raise ValueError(f"the image is about {len(payload) * 3 // 4} bytes; at most {MAX_IMAGE_BYTES} are accepted: "
                         "send a smaller image")
    try:
        data = base64.b64decode(re.sub(r"\s+", "", payload), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the image's data is not valid base64") from None
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("this server cannot decode images: Pillow is not installed (pip install 'tiderl[vision]')") \
            from None
    try:
        image = Image.open(io.BytesIO(data))
        if max(image.size) > MAX_IMAGE_SIDE:
            raise ValueError(f"the image is {image.size[0]}x{image.size[1]} pixels; at most {MAX_IMAGE_SIDE} a side "
                             "are accepted: send a smaller image")
        image.load()
        return image.convert("RGB")
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever Pillow raises on bytes that are no image
        raise ValueError(f"the image's bytes cannot be decoded ({match.group(1)}: {type(exc).__name__})") from None


def image_key(image: Any) -> str:
    """What identifies an image when a client sends the conversation again: a hash of its pixels
    (the same picture re-encoded is the same image)."""
    digest = hashlib.sha256(f"{image.mode}{image.size}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def takes_images(tokenizer: Any) -> bool:
    """Whether the served model reads images: its tokenizer is a processor with an image processor."""
    return getattr(tokenizer, "image_processor", None) is not None


def has_images(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("images") for m in messages)


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Request messages as the chat format takes them: a message with images gets the content
    `Observation(text, images)`; the others are unchanged."""
    out = []
    for m in messages:
        rest = {k: v for k, v in m.items() if k not in ("images", "image_keys")}
        out.append({**rest, "content": Observation(m.get("content") or "", list(m["images"]))} if m.get("images")
                   else rest)
    return out


def image_prompt_ids(fmt: Any, messages: list[dict[str, Any]], continuation: bool) -> list[int]:
    """The tokens of `messages` some of which hold images, each image's placeholder tokens
    expanded by the chat format's processor: the whole prompt (`fmt.prompt_with_images`), or, when
    `continuation`, what follows a recorded assistant turn (`fmt.continuation_with_images`)."""
    chat = chat_messages(messages)
    return (fmt.continuation_with_images(chat) if continuation else fmt.prompt_with_images(chat))[0]


async def generate(client: Any, prompt: list[int], images: list[Any], forced: list[int], params: Any) -> Any:
    """The engine's completion of `prompt`; `images` are the prompt's images in token order and
    `forced` flags the prompt tokens the model did not sample (the image features go to forced
    placeholders only, as the trainer puts them: `tiderl.models.vision.PromptImages`)."""
    if images:
        from tiderl.models.vision import PromptImages

        return await client.generate(prompt, params, images=PromptImages(list(images), forced))
    return await client.generate(prompt, params)


def describe(image: Any) -> dict[str, Any]:
    """An image as JSON (a session's record): its size and key, not its pixels."""
    return {"width": image.size[0], "height": image.size[1], "key": image_key(image)}
