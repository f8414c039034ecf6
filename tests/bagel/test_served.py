"""`mstar serve bagel` (tiny) through the official openai client: images.generate / images.edit give PNGs, chat
answers about an image, bad input is a 4xx naming the field."""

from __future__ import annotations

import base64
import io

import pytest

openai = pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")

# `client`: the session's tiny BAGEL server (tests/bagel/conftest.py)


def _png(w=40, h=30) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 10)).save(buf, format="PNG")
    return buf.getvalue()


def _image(item) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(item.b64_json)))


def test_images_generate_and_edit_give_pngs(client):
    r = client.images.generate(model="bagel", prompt="a red fox", size="32x16", extra_body={"seed": 3, "num_steps": 2})
    assert _image(r.data[0]).size == (32, 16)
    again = client.images.generate(model="bagel", prompt="a red fox", size="32x16", extra_body={"seed": 3, "num_steps": 2})
    assert again.data[0].b64_json == r.data[0].b64_json  # same seed, same image
    r = client.images.edit(model="bagel", prompt="make it blue", image=("in.png", _png(), "image/png"),
                           extra_body={"num_steps": 2, "seed": 1})
    # drawn at BAGEL's VAE grid (672x512 for this input), answered at the input's size as OpenAI's edits answer
    assert _image(r.data[0]).size == (40, 30)


def test_an_edit_answers_at_the_input_size_unless_a_size_is_asked(client):
    """A 256x256 input: its edit is 256x256 (absent size, or `auto`); an asked size is the answer's size."""
    square = _png(256, 256)
    for size in ({}, {"size": "auto"}):
        r = client.images.edit(model="bagel", prompt="make it blue", image=("in.png", square, "image/png"),
                               extra_body={"num_steps": 1, "seed": 1, **size})
        assert _image(r.data[0]).size == (256, 256)
    r = client.images.edit(model="bagel", prompt="make it blue", image=("in.png", square, "image/png"),
                           size="96x64", extra_body={"num_steps": 1, "seed": 1})
    assert _image(r.data[0]).size == (96, 64)
    auto = client.images.generate(model="bagel", prompt="a red fox", size="auto", extra_body={"seed": 3, "num_steps": 1})
    default = client.images.generate(model="bagel", prompt="a red fox", extra_body={"seed": 3, "num_steps": 1})
    assert auto.data[0].b64_json == default.data[0].b64_json  # auto: the model's default size


def test_n_images_in_one_request_equal_single_requests_seeded_apart(client):
    both = client.images.generate(model="bagel", prompt="two foxes", size="16x16", n=2,
                                  extra_body={"seed": 9, "num_steps": 2})
    singles = [client.images.generate(model="bagel", prompt="two foxes", size="16x16",
                                      extra_body={"seed": 9 + i, "num_steps": 2}) for i in range(2)]
    assert [d.b64_json for d in both.data] == [s.data[0].b64_json for s in singles]


def test_chat_answers_about_an_image(client):
    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    r = client.chat.completions.create(model="bagel", max_tokens=4, seed=0, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is this?"}]}])
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


def test_a_think_that_draws_no_image_is_a_422_with_its_text(client):
    # +100 on <|im_end|> (258): the thought ends at once, with text and no image; an images client gets a clear error
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.images.generate(model="bagel", prompt="a red fox", size="16x16",
                               extra_body={"task": "think", "logit_bias": {"258": 100}, "num_steps": 2})
    assert err.value.body.get("param") == "task" and "drew no image" in str(err.value)
    # the native route answers the same request with the text
    import httpx

    url = str(client.base_url).rstrip("/") + "/walks/bagel"
    r = httpx.post(url, json={"stream": False, "inputs": {"task": "think", "prompt": "a red fox",
                                                           "logit_bias": {"258": 100}}}, timeout=60)
    out = r.json()["outputs"]
    assert r.status_code == 200 and out["finish_reason"] == "stop" and "image" not in out and "text" in out
    # the thought that opens an image (+100 on <|vision_start|>, 259) is drawn
    r = client.images.generate(model="bagel", prompt="a red fox", size="16x16",
                               extra_body={"task": "think", "logit_bias": {"259": 100}, "num_steps": 2})
    assert _image(r.data[0]).size == (16, 16)


@pytest.mark.parametrize(("call", "param"), [
    (lambda c: c.images.generate(model="bagel", prompt="x", size="30x32"), "size"),
    (lambda c: c.images.generate(model="bagel", prompt="x", size="2048x2048"), "size"),
    (lambda c: c.images.generate(model="bagel", prompt="", size="32x32"), "prompt"),
    (lambda c: c.images.edit(model="bagel", prompt="x", image=("a.png", b"not an image", "image/png")), "image"),
    (lambda c: c.images.generate(model="bagel", prompt="x", size="32x32", extra_body={"guidance_scale": 99}),
     "guidance_scale"),
])
def test_bad_input_is_a_4xx_naming_the_field(client, call, param):
    with pytest.raises(openai.BadRequestError) as err:
        call(client)
    assert err.value.body.get("param") == param or param in str(err.value)


@pytest.mark.slow
def test_mstar_run_writes_an_image(tmp_path):
    import subprocess
    import sys

    from tests.server.helpers import server_env

    out = tmp_path / "fox.png"
    proc = subprocess.run([sys.executable, "-m", "mstar_core.cli", "run", "bagel", "--prompt", "a red fox", "--out",
                           str(out), "--size", "32x16", "--seed", "1", "--no-progress"],
                          env=server_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Image.open(out).size == (32, 16)
