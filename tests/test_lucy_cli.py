"""`lucy` subcommands run as subprocesses against a fabricated HF cache and a tmp POLY_HOME."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poly.errors import EXIT_CODES
from tests.hf_fixtures import make_tiny_checkpoint

REPO = "test-org/tiny-llama"
REV_OLD = "1" * 40
REV_MAIN = "2" * 40
SUBCOMMANDS = ["models", "chat", "convert", "generate", "bench", "inspect", "demo", "download"]


# --- fixtures: a tiny random llama in a fabricated HF cache ------------------------------------


def make_snapshot(out: Path, layers: int, seed: int) -> Path:
    """A tiny random llama (tests/hf_fixtures) that answers in at most 6 greedy tokens."""
    return make_tiny_checkpoint(
        out,
        "llama",
        seed=seed,
        config_overrides={"num_hidden_layers": layers},
        generation={"max_new_tokens": 6, "do_sample": False},
    )


def fabricate_cache(hub: Path, repo: str, src: Path, revisions: dict[str, Path], main: str) -> Path:
    """HF hub layout: blobs by sha256, snapshots/<rev>/ symlinks, refs/main → `main`."""
    root = hub / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    for rev, folder in revisions.items():
        snap = root / "snapshots" / rev
        snap.mkdir(parents=True, exist_ok=True)
        for f in sorted(folder.iterdir()):
            data = f.read_bytes()
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(main)
    return root / "snapshots" / main


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """tmp HF_HOME with one repo of two snapshots (refs/main → the 2-layer one) + POLY_HOME."""
    base = tmp_path_factory.mktemp("lucy")
    old = make_snapshot(base / "src-old", layers=1, seed=1)
    new = make_snapshot(base / "src-new", layers=2, seed=0)
    hub = base / "hf" / "hub"
    snap = fabricate_cache(hub, REPO, new, {REV_OLD: old, REV_MAIN: new}, REV_MAIN)
    env = dict(os.environ)
    env.update(
        HF_HOME=str(base / "hf"),
        HF_HUB_OFFLINE="1",
        POLY_HOME=str(base / "poly"),
        NO_COLOR="1",
        COLUMNS="200",
    )
    env.pop("HF_HUB_CACHE", None)
    return {"base": base, "snapshot": snap, "src": new, "env": env}


def lucy(world, *args, input=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "lucy", *args],
        env=world["env"],
        capture_output=True,
        text=True,
        input=input,
        timeout=timeout,
        cwd=world["base"],
    )


def one_error_line(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("lucy: error: "), lines[0]
    return lines[0]


# --- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sub", [None, *SUBCOMMANDS])
def test_help_exits_zero(world, sub):
    proc = lucy(world, *([sub] if sub else []), "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: lucy" in proc.stdout


def test_models_json_lists_main_snapshot(world):
    from transformers import LlamaForCausalLM

    proc = lucy(world, "models", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    hf = [r for r in rows if r["kind"] == "hf"]
    assert [r["name"] for r in hf] == [REPO]
    row = hf[0]
    assert row["revision"] == REV_MAIN
    assert Path(row["path"]).resolve() == world["snapshot"].resolve()
    assert row["supported"] is True
    assert row["architecture"]
    # reference count from transformers itself (tied head counted once, as safetensors stores it)
    ref = LlamaForCausalLM.from_pretrained(world["src"]).num_parameters()
    assert row["parameters"] == ref


def test_unknown_subcommand_is_usage_error(world):
    proc = lucy(world, "frobnicate")
    one_error_line(proc)
    assert proc.returncode == 2


def test_kv_cache_choices_are_checked(world):
    proc = lucy(world, "bench", str(world["snapshot"]), "--kv-cache", "bf16")
    assert proc.returncode == 2 and "--kv-cache" in proc.stderr


def test_bad_quant_is_usage_error(world):
    proc = lucy(world, "convert", str(world["snapshot"]), "--quant", "q5")
    assert "--quant" in one_error_line(proc)
    assert proc.returncode == 2


def test_missing_model(world):
    proc = lucy(world, "generate", str(world["base"] / "nope.entity"), "--prompt", "hi")
    one_error_line(proc)
    assert proc.returncode == 3


def test_corrupt_file(world):
    bad = world["base"] / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(60))
    proc = lucy(world, "inspect", str(bad))
    one_error_line(proc)
    assert proc.returncode == 4


@pytest.mark.parametrize(
    "flag,value",
    [("--temperature", "-1"), ("--top-p", "1.5"), ("--top-k", "-5"), ("--max-tokens", "0")],
)
def test_bad_sampling_value(world, flag, value):
    proc = lucy(world, "generate", str(world["snapshot"]), "--prompt", "hi", flag, value)
    line = one_error_line(proc)  # the flag as typed, never the Python field name
    assert line.startswith(f"lucy: error: {flag} must be ") and f"got {value}" in line
    assert proc.returncode == 2


def test_convert_refuses_existing_output(world):
    out = world["base"] / "exists.entity"
    out.write_bytes(b"keep me")
    proc = lucy(world, "convert", str(world["snapshot"]), "-o", str(out))
    one_error_line(proc)
    assert proc.returncode == 7
    assert out.read_bytes() == b"keep me"


def test_download_without_network(world):
    proc = lucy(world, "download", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "no network" in one_error_line(proc)
    assert proc.returncode == 10  # NoNetworkError: its own exit code
    assert EXIT_CODES[proc.returncode]


@pytest.mark.parametrize("by", ["path", "model_id", "kv-f16"])
def test_generate_json_matches_transformers_greedy(world, by):
    """`--greedy --json`: one object; tokens equal transformers' greedy continuation of the
    refs/main snapshot, whether MODEL is its path or the cached model id, and with the float16
    KV cache (`--kv-cache f16`) too."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    prompt = "hello there, how are"
    proc = lucy(
        world,
        "generate",
        str(world["snapshot"]) if by == "path" else REPO,
        "--prompt",
        prompt,
        "--greedy",
        "--max-tokens",
        "8",
        "--json",
        *(("--kv-cache", "f16") if by == "kv-f16" else ()),
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1
    res = json.loads(proc.stdout)
    for key in ("text", "tokens", "prompt_tokens", "prefill_tok_s", "decode_tok_s"):
        assert key in res
    tok = AutoTokenizer.from_pretrained(world["src"])
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert res["prompt_tokens"] == len(ids)
    model = LlamaForCausalLM.from_pretrained(world["src"])
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([ids]),
            max_new_tokens=len(res["tokens"]),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert res["tokens"] == ref[0, len(ids) :].tolist()
    assert res["prefill_tok_s"] > 0 and res["decode_tok_s"] > 0


def test_bench_json(world):
    proc = lucy(
        world,
        "bench",
        str(world["snapshot"]),
        "--prompt-tokens",
        "12",
        "--new-tokens",
        "4",
        "--runs",
        "1",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["prompt_tokens"] == 12 and res["new_tokens"] == 4
    for key in ("prefill_tok_s", "decode_tok_s", "peak_rss_mb", "load_s"):
        assert res[key] > 0, key
    # the process held at least the float32 weights it ran on
    assert res["peak_rss_mb"] * 2**20 > (world["src"] / "model.safetensors").stat().st_size


def test_inspect_json_counts_match_transformers(world):
    """Layer parameters + embeddings + head + final norm = transformers' parameter count."""
    from transformers import AutoConfig, LlamaForCausalLM

    proc = lucy(world, "inspect", str(world["snapshot"]), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    hf_cfg = AutoConfig.from_pretrained(world["src"])
    assert data["config"]["num_layers"] == hf_cfg.num_hidden_layers
    assert data["config"]["hidden_size"] == hf_cfg.hidden_size
    assert (
        data["grid"]["layers_per_cell"]
        * data["grid"]["depth"]
        * data["grid"]["rows"]
        * data["grid"]["cols"]
        == hf_cfg.num_hidden_layers
    )
    model = LlamaForCausalLM.from_pretrained(world["src"])
    head = model.lm_head.weight.numel() + model.model.embed_tokens.weight.numel()
    final_norm = model.model.norm.weight.numel()
    layers = sum(r["params"] for r in data["layers"])
    assert layers + head + final_norm - zero_bias_count(hf_cfg) == model.num_parameters()


def zero_bias_count(cfg) -> int:
    # our layouts always carry bias slots (zero for llama): q + 2·kv + d per MHA, 2·I + d per SwiGLU
    kv = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    per_layer = (
        cfg.hidden_size + 2 * kv + cfg.hidden_size + 2 * cfg.intermediate_size + cfg.hidden_size
    )
    return cfg.num_hidden_layers * per_layer


def test_models_json_counts_parameters_of_a_q4_entity(world, tmp_path):
    """q4 blobs are packed bytes: the count comes from the dims and must equal transformers'."""
    from transformers import LlamaForCausalLM

    import entity

    home = tmp_path / "poly"
    out = home / "entities" / "tiny-q4.entity"
    out.parent.mkdir(parents=True)
    entity.convert(str(world["src"]), str(out), quant="q4")
    proc = subprocess.run(
        [sys.executable, "-m", "lucy", "models", "--json"],
        env={**world["env"], "POLY_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    row = next(r for r in json.loads(proc.stdout) if r["kind"] == "entity")
    assert row["dtype"] == "q4"
    assert row["parameters"] == LlamaForCausalLM.from_pretrained(world["src"]).num_parameters()
