"""Image content parts in `tiderl serve` (tiderl/serve/images.py, docs/serve.md): base64
data URLs decode to PIL images and anything else is a 400 naming the part; a text-only model
refuses images cleanly over HTTP; with a model that reads images (a stand-in: the tiny tokenizer
behind a processor-like wrapper), a recorded session's images come out in order on its
Trajectory, reach the engine with the prompt, and survive the session record and the
trajectory file."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("PIL", reason="image parts are decoded with Pillow: pip install 'tiderl[vision]'")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from PIL import Image  # noqa: E402

from tiderl.agent.loop import ScriptedEngine  # noqa: E402
from tiderl.embedded.tiny import train_tokenizer  # noqa: E402
from tiderl.rollout.base import Completion  # noqa: E402
from tiderl.serve import images, wire  # noqa: E402
from tiderl.serve.server import BackgroundServer, ChatService, create_app, record_to  # noqa: E402
from tiderl.serve.session import SessionStore  # noqa: E402
from tiderl.serve.wire import RequestError, message_key, read_request  # noqa: E402
from tiderl.train.value_pretrain import load_trajectories  # noqa: E402


def picture(colour, size=(8, 6)):
    return Image.new("RGB", size, colour)


def part(image_or_url):
    url = image_or_url if isinstance(image_or_url, str) else images.encode_data_url(image_or_url)
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts):
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["What colour is the square? red green blue <img> The answer is red."] * 4, vocab_size=300)


# ----------------------------------------------------------------------------- the wire format

def test_image_parts_decode_to_pil_images_in_order():
    red, blue = picture((255, 0, 0)), picture((0, 0, 255), (5, 7))
    request = read_request({"messages": [user("look: ", part(red), part(blue), "which is red?")]})
    message = request.messages[0]
    assert message["content"] == "look: which is red?"
    assert [i.tobytes() for i in message["images"]] == [red.tobytes(), blue.tobytes()]
    assert message["images"][1].size == (5, 7) and message["images"][0].mode == "RGB"
    assert message["image_keys"] == [images.image_key(red), images.image_key(blue)]
    # A tool message may show an image too (an environment's Observation); a bare string url is read.
    tool = read_request({"messages": [{"role": "tool", "content": [{"type": "image_url",
                                                                    "image_url": images.encode_data_url(red)}]}]})
    assert tool.messages[0]["content"] == "" and len(tool.messages[0]["images"]) == 1
    # RGBA and palette images come back as RGB; a message without images has no image keys.
    rgba = read_request({"messages": [user(part(Image.new("RGBA", (3, 3), (1, 2, 3, 4))))]})
    assert rgba.messages[0]["images"][0].getpixel((0, 0)) == (1, 2, 3)
    assert "images" not in read_request({"messages": [user("hi")]}).messages[0]


def test_the_same_picture_is_the_same_message_and_another_is_not():
    red = picture((255, 0, 0))
    first = read_request({"messages": [user("q", part(red))]}).messages[0]
    again = read_request({"messages": [user("q", part(red.convert("P").convert("RGB")))]}).messages[0]
    other = read_request({"messages": [user("q", part(picture((254, 0, 0))))]}).messages[0]
    assert message_key(first) == message_key(again) != message_key(other)


@pytest.mark.parametrize("bad_part, says", [
    (part("https://example.com/cat.png"), "not a base64 data URL"),
    (part("data:image/png,rawbytes"), "not a base64 data URL"),
    (part("data:text/plain;base64,aGVsbG8="), "not a base64 data URL"),
    (part("data:image/png;base64,***"), "not valid base64"),
    (part("data:image/png;base64," + base64.b64encode(b"not an image at all").decode()), "cannot be decoded"),
    ({"type": "image_url", "image_url": {}}, "must be a string"),
    ({"type": "input_audio", "input_audio": {}}, "not a text part"),
    ({"type": "text", "text": 3}, "not a text part"),
])
def test_bad_image_parts_are_400s_naming_the_part(bad_part, says):
    with pytest.raises(RequestError, match=says) as e:
        read_request({"messages": [{"role": "system", "content": "s"}, user("look", bad_part)]})
    assert e.value.status == 400 and e.value.param == "messages[1].content[1]"
    assert str(e.value).startswith("messages[1].content[1]")


def test_images_are_capped_and_only_user_and_tool_messages_hold_them(monkeypatch):
    big = picture((0, 0, 0), (40, 10))
    monkeypatch.setattr(images, "MAX_IMAGE_SIDE", 32)
    with pytest.raises(RequestError, match="40x10 pixels; at most 32 a side"):
        read_request({"messages": [user(part(big))]})
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 16)
    with pytest.raises(RequestError, match="at most 16 are accepted"):
        read_request({"messages": [user(part(picture((1, 1, 1))))]})
    monkeypatch.undo()
    monkeypatch.setattr(wire, "MAX_IMAGES", 2)
    with pytest.raises(RequestError, match="3 images; at most 2") as e:
        read_request({"messages": [user(part(big), part(big)), user(part(big))]})
    assert e.value.param == "messages"
    with pytest.raises(RequestError, match="image part in a message of role system"):
        read_request({"messages": [{"role": "system", "content": [part(big)]}, user("hi")]})


# ----------------------------------------------------------------------------- a text-only model

def post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_text_only_model_refuses_images_with_a_clear_400(tokenizer):
    engine = ScriptedEngine(tokenizer, {"colour": ["The answer is red."]})
    service = ChatService(engine, tokenizer, "tiny-text", max_new_tokens=16, max_total_tokens=512)
    with BackgroundServer(create_app(service)) as srv:
        status, body = post(f"{srv.url}/v1/chat/completions",
                            {"model": "m", "messages": [user("What colour is the square?", part(picture((255, 0, 0))))]})
        assert status == 400 and body["error"]["code"] == "images_not_supported"
        assert body["error"]["message"].startswith("model tiny-text takes no images")
        assert body["error"]["param"] == "messages"
        # A session records nothing of the refused request; text still works.
        status, created = post(f"{srv.url}/sessions", {})
        sid = created["session_id"]
        status, _ = post(f"{srv.url}/sessions/{sid}/v1/chat/completions",
                         {"messages": [user("What colour is the square?", part(picture((0, 0, 255))))]})
        assert status == 400 and service.store.get(sid).segments == []
        status, body = post(f"{srv.url}/sessions/{sid}/v1/chat/completions",
                            {"messages": [user("What colour is the square?")]})
        assert status == 200 and body["choices"][0]["message"]["content"] == "The answer is red."


# ----------------------------------------------------------------------------- a model that reads images

@pytest.fixture(scope="module")
def vision():
    """The tiny vision-language model's processor, answering as its tokenizer (`ChatProcessor`)."""
    from tiderl.embedded.tiny_vlm import build_tiny_vlm, image_seq_len
    from tiderl.models.vision import ChatProcessor

    _, processor = build_tiny_vlm(["What colour is the square? The answer is red.", "and this one?", "Answer."])
    return ChatProcessor(processor), image_seq_len(64, 16, 2)


class RecordingClient:
    """The engine's client: answers every prompt with `reply` and keeps the images it was given
    (with the prompt tokens it was told are forced)."""

    def __init__(self, tokenizer, reply):
        self.ids = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.seen, self.forced = [], []

    async def generate(self, prompt, params, images=None):
        self.seen.append(list(images.images) if images else [])
        self.forced.append((len(prompt), list(images.forced)) if images else None)
        return Completion(self.ids, [0.0] * len(self.ids), "", "stop", [0] * len(self.ids))


def test_a_recorded_sessions_images_come_out_in_order_on_its_trajectory(vision, tmp_path):
    processor, per_image = vision
    tokenizer = processor.tokenizer
    out = tmp_path / "sessions.jsonl"
    service = ChatService(ScriptedEngine(tokenizer, {}), processor, "tiny-vision", max_new_tokens=16,
                          max_total_tokens=1024, store=SessionStore(on_finish=record_to(out)))
    client = service.client = RecordingClient(tokenizer, "The answer is red.")
    session = service.store.create("s1", task_id="colours")
    red, green, blue = picture((255, 0, 0)), picture((0, 255, 0)), picture((0, 0, 255))

    def complete(messages):
        body, _ = asyncio.run(service.complete(read_request({"messages": messages}), session))
        return body["choices"][0]["message"]

    messages = [{"role": "system", "content": "Answer."}, user("What colour is the square?", part(red))]
    messages.append(complete(messages))
    messages.append({"role": "tool", "content": [part(green), {"type": "text", "text": "and this one?"}]})
    messages.append(user(part(blue)))
    complete(messages)
    # The engine got each prompt's images, in order; one segment grew (the first turn reused).
    assert [[i.tobytes() for i in seen] for seen in client.seen] == [
        [red.tobytes()], [red.tobytes(), green.tobytes(), blue.tobytes()]]
    [segment] = session.segments
    assert session.requests[1]["reused_prompt_tokens"] > 0 and session.requests[1]["images"] == 3
    text = tokenizer.decode(segment.tokens)
    assert text.count("<image>") == 3 * per_image and text.index("<image>") < text.index("What colour")
    # The engine is told which prompt tokens were forced: all but the first reply's sampled ones.
    (n0, forced0), (n1, forced1) = client.forced
    assert forced0 == [1] * n0 and len(forced1) == n1
    assert [1 - f for f in forced1[:len(segment.loss_mask)]] == segment.loss_mask[:len(forced1)]
    assert forced1.count(0) == len(client.ids)
    record = json.loads(json.dumps(session.to_dict()))  # JSON-ready: images described, not embedded
    assert [i["key"] for i in record["segments"][0]["images"]] == [images.image_key(i) for i in (red, green, blue)]
    assert record["segments"][0]["messages"][1]["images"][0]["width"] == 8

    service.store.finish("s1", 1.0)
    [trajectory] = session.trajectories()
    assert [i.tobytes() for i in trajectory.images] == [red.tobytes(), green.tobytes(), blue.tobytes()]
    assert trajectory.tokens == segment.tokens and trajectory.reward == 1.0
    # The trajectory file holds them as PNG data URLs, read back as images pixel for pixel; the
    # trajectory itself keeps its images (writing the record does not change them).
    line = json.loads(out.read_text().splitlines()[0])
    assert all(u.startswith("data:image/png;base64,") for u in line["images"])
    [saved] = load_trajectories(out)
    assert [i.tobytes() for i in saved.images] == [i.tobytes() for i in (red, green, blue)]
    assert [i.tobytes() for i in trajectory.images] == [i.tobytes() for i in (red, green, blue)]


def test_requests_outside_sessions_pass_images_to_the_engine(vision):
    processor, _ = vision
    tokenizer = processor.tokenizer
    service = ChatService(ScriptedEngine(tokenizer, {}), processor, "tiny-vision", max_new_tokens=16,
                          max_total_tokens=1024)
    client = service.client = RecordingClient(tokenizer, "red")
    body, _ = asyncio.run(service.complete(read_request({"messages": [user("colour?", part(picture((9, 9, 9))))]}),
                                           None))
    assert body["choices"][0]["message"]["content"] == "red" and len(client.seen[0]) == 1
    assert body["usage"]["prompt_tokens"] > len(tokenizer.encode("colour?"))
