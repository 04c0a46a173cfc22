"""`lucy serve` KV on disk: llama.cpp's slot save/restore and the --prompt-cache folder, across a
real restart of the server process (tiny random model, official openai client)."""

from __future__ import annotations

import json
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.hf_fixtures import make_tiny_checkpoint  # noqa: E402
from tests.serve_helpers import KEY, metrics, post, running_server  # noqa: E402

MODEL = "tiny-kv"
LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kvp") / MODEL, "llama", seed=11)


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _complete(base, prompt, n=8):
    return _client(base).completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                            temperature=0)  # fmt: skip


def _slot(base, action, filename=None, slot=0):
    body = {} if filename is None else {"filename": filename}
    return post(f"{base}/slots/{slot}?action={action}", json.dumps(body).encode())


def test_slot_save_restart_restore_continues_as_uninterrupted(ckpt, tmp_path):
    folder = tmp_path / "slots"
    folder.mkdir()
    with running_server(ckpt, "--slot-save-path", str(folder)) as (base, _):
        a = _complete(base, LONG)
        status, saved = _slot(base, "save", "a.kv")
        assert status == 200, saved
        n_ctx = a.usage.prompt_tokens + a.usage.completion_tokens - 1  # the last is not run yet
        assert saved["n_saved"] == n_ctx and saved["filename"] == "a.kv"
        assert saved["n_written"] == (folder / "a.kv").stat().st_size
        follow = LONG + a.choices[0].text + " and then"
        uninterrupted = _complete(base, follow, 12)
    with running_server(ckpt, "--slot-save-path", str(folder)) as (base, _):
        status, restored = _slot(base, "restore", "a.kv")
        assert status == 200, restored
        assert restored["n_restored"] == n_ctx and restored["id_slot"] == 0
        before = metrics(base)
        again = _complete(base, follow, 12)
        after = metrics(base)
    assert again.choices[0].text == uninterrupted.choices[0].text
    hit = after["poly_prefix_cache_hit_tokens_total"] - before["poly_prefix_cache_hit_tokens_total"]
    assert hit >= a.usage.prompt_tokens - 1  # the restored positions, not a prefill
    ran = after["poly_prompt_tokens_total"] - before["poly_prompt_tokens_total"]
    assert ran == again.usage.prompt_tokens - hit


def test_bad_files_and_names_are_one_line_4xx(ckpt, tmp_path):
    import entity

    folder, outside = tmp_path / "slots", tmp_path / "outside.kv"
    folder.mkdir()
    other = entity.load(make_tiny_checkpoint(tmp_path / "other", "llama", seed=12))
    ids = list(other.tokenizer.encode("hello there"))
    other.forward(ids)
    other.save_state(folder / "other.kv", tokens=ids)  # same shapes, other weights
    (folder / "junk.kv").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + b"\0" * 64)
    with running_server(ckpt, "--slot-save-path", str(folder)) as (base, _):
        assert _slot(base, "save", "empty.kv")[0] == 400  # nothing ran in slot 0 yet
        _complete(base, LONG)
        assert _slot(base, "save", "good.kv")[0] == 200
        good = (folder / "good.kv").read_bytes()
        (folder / "cut.kv").write_bytes(good[: len(good) - 100])
        flipped = bytearray(good)
        flipped[-5] ^= 0xFF
        (folder / "flipped.kv").write_bytes(bytes(flipped))
        cases = {"other.kv": (400, "state_mismatch"), "junk.kv": (400, "bad_state"),
                 "cut.kv": (400, "bad_state"), "flipped.kv": (400, "bad_state"),
                 "missing.kv": (404, "not_found")}  # fmt: skip
        for name, (want, code) in cases.items():
            status, body = _slot(base, "restore", name)
            assert (status, body["error"]["code"]) == (want, code), (name, body)
            assert "\n" not in body["error"]["message"] and "Traceback" not in json.dumps(body)
        for name in ("../outside.kv", str(outside), "a/b.kv", ".hidden", "", " x.kv", "a\\b"):
            status, body = _slot(base, "save", name)
            assert (status, body["error"]["code"]) == (400, "invalid_filename"), name
        assert _slot(base, "restore", "good.kv")[0] == 200
        status, erased = _slot(base, "erase")
        assert status == 200 and erased["n_erased"] > 0
        assert _slot(base, "save", "x.kv", slot=99)[0] == 400
    assert not outside.exists() and not (tmp_path / "b.kv").exists()
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary files


def test_slots_need_a_folder(ckpt):
    with running_server(ckpt) as (base, _):
        _complete(base, "hi")
        status, body = _slot(base, "save", "a.kv")
        assert status == 501 and body["error"]["code"] == "not_supported"


def _wait_files(folder, n: int, timeout: float = 30.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(folder.glob("*.kvstate"))
        if len(files) >= n:
            return files
        time.sleep(0.1)
    return sorted(folder.glob("*.kvstate"))


def test_prompt_cache_skips_the_prefill_after_a_restart(ckpt, tmp_path):
    folder = tmp_path / "pc"
    folder.mkdir()
    args = ("--prompt-cache", str(folder), "--prompt-cache-min", "32")
    with running_server(ckpt, *args) as (base, _):
        first = _complete(base, LONG, 10)
        _complete(base, "short prompt", 4)  # under --prompt-cache-min: not stored
        assert len(_wait_files(folder, 1)) == 1
    with running_server(ckpt, *args) as (base, _):
        before = metrics(base)
        again = _complete(base, LONG, 10)
        after = metrics(base)
    assert again.choices[0].text == first.choices[0].text
    assert after["poly_prompt_cache_loaded"] == 1
    # only the prompt's last token runs (its logits give the first reply token)
    assert after["poly_prompt_tokens_total"] - before["poly_prompt_tokens_total"] == 1
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_prompt_cache_is_bounded_oldest_first(ckpt, tmp_path):
    folder = tmp_path / "pc"
    folder.mkdir()
    with running_server(ckpt, "--prompt-cache", str(folder), "--prompt-cache-min", "32") as (
        base,
        _,
    ):
        _complete(base, LONG, 2)
        one = _wait_files(folder, 1)[0].stat().st_size
    # room for one file of this size only: the second prompt's file replaces the first
    mb = str(1.5 * one / (1 << 20))
    with running_server(ckpt, "--prompt-cache", str(folder), "--prompt-cache-min", "32",
                        "--prompt-cache-mb", mb) as (base, _):  # fmt: skip
        first = _wait_files(folder, 1)[0]
        time.sleep(1.1)  # a later mtime than the first file's
        _complete(base, "Another long prompt about foxes and dogs and cats. " * 4, 2)
        deadline = time.monotonic() + 30
        while first.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    files = sorted(folder.glob("*.kvstate"))
    assert not first.exists() and len(files) == 1
