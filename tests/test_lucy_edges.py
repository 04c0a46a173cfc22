"""`lucy` at its edges (issue 55, items 7, 9, 11): bad POLY_* environment variables, the menu
with empty or nearly empty caches, Ctrl-C while a reply streams, a reader that leaves the pipe,
what `inspect` says weights are held as, and the GGUF files `models` lists. Every check runs
the real CLI in a subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pexpect
import pytest

from lucy import environment
from poly.errors import UsageError
from tests.test_lucy_cli import one_error_line, world, zero_bias_count  # noqa: F401 - fixture

MENU = "Select [1]: "
DOCS = Path(__file__).parent.parent / "docs"


def run_lucy(env, *args, input="", timeout=240, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "lucy", *args],
        env=env,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


# --- 7: POLY_* variables are checked before poly reads them -------------------------------------


@pytest.mark.parametrize(
    "name, value",
    [
        ("POLY_BACKEND", "cuda"),  # was a UsageError traceback, exit 1
        ("POLY_NUM_THREADS", "abc"),  # was a ValueError traceback
        ("POLY_NUM_THREADS", "0"),
        ("POLY_ISA", "avx3"),  # was accepted silently (the C side ignored it)
        ("POLY_ACT_Q8", "yes"),  # was silently "auto"
    ],
)
def test_bad_environment_variable_is_one_line_and_exit_2(world, name, value):  # noqa: F811
    proc = run_lucy({**world["env"], name: value}, "models")
    line = one_error_line(proc)
    assert proc.returncode == UsageError.exit_code == environment.USAGE_EXIT
    assert f"{name}='{value}'" in line
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "name, value", [("POLY_BACKEND", " C "), ("POLY_ISA", "avx2"), ("POLY_NUM_THREADS", "1")]
)
def test_good_environment_variables_still_run(world, name, value):  # noqa: F811
    proc = run_lucy({**world["env"], name: value}, "models", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)


def test_docs_list_exactly_the_checked_variables():
    text = (DOCS / "lucy.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `(POLY_[A-Z0-9_]+)` \|", section, re.M)
    assert sorted(documented) == sorted(environment.VARIABLES)


# --- 9: every menu prompt at EOF leaves with 0; empty lists say so ------------------------------


@pytest.fixture(scope="module")
def only_entity(world, tmp_path_factory):  # noqa: F811
    """An empty HF cache and one small .entity (the state after `lucy demo` on a new machine)."""
    import entity

    base = tmp_path_factory.mktemp("only-entity")
    home = base / "home"  # not "poly": a poly/ dir in the cwd would shadow the package
    (home / "entities").mkdir(parents=True)
    entity.convert(str(world["src"]), str(home / "entities" / "tiny.f32.entity"), quant="f32")
    env = {**world["env"], "HF_HOME": str(base / "hf"), "POLY_HOME": str(home)}
    return {"env": env, "base": base}


def _menu(env, typed: str, cwd):
    proc = run_lucy(env, input=typed, cwd=cwd)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-2000:]
    assert "error" not in out and "Traceback" not in out, out[-2000:]
    return proc.stdout


@pytest.mark.parametrize("typed", ["1\n", "2\n", "4\n", "5\n"])
def test_eof_at_a_model_list_exits_zero_without_error(only_entity, typed):
    """EOF at `Select model number [1]:` used to print `error: MenuExit:`; [2] with an empty
    HF cache says so and goes back to the menu instead of asking for an .entity."""
    out = _menu(only_entity["env"], typed, only_entity["base"])
    if typed == "2\n":
        assert "nothing to convert" in out
        assert out.count(MENU) == 2  # back at the menu, then EOF
    else:
        assert "Select model number [1]: " in out


@pytest.mark.parametrize("typed", ["1\n0\n0\n", "4\n0\n0\n", "5\n0\n0\n"])
def test_a_model_list_has_a_way_back(only_entity, typed):
    out = _menu(only_entity["env"], typed, only_entity["base"])
    assert out.count(MENU) == 2 and "unknown choice" not in out


@pytest.mark.parametrize("typed", ["1\n", "2\n", "4\n", "5\n"])
def test_empty_caches_say_so_and_return_to_the_menu(tmp_path, typed):
    import os

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "POLY_HOME": str(tmp_path / "home")}
    env.update(HF_HUB_OFFLINE="1", NO_COLOR="1", COLUMNS="200")
    out = _menu(env, typed, tmp_path)
    assert out.count(MENU) == 2
    assert "no models found" in out or "nothing to convert" in out


def test_menu_in_a_terminal_empty_hf_cache_then_ctrl_d(only_entity):
    child = pexpect.spawn(
        sys.executable,
        ["-m", "lucy"],
        env={**only_entity["env"], "TERM": "xterm"},
        cwd=str(only_entity["base"]),
        encoding="utf-8",
        timeout=120,
    )
    child.expect_exact(MENU)
    child.sendline("2")
    child.expect_exact("nothing to convert")
    child.expect_exact(MENU)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert "error" not in child.before


# --- 11: small things ---------------------------------------------------------------------------


def test_ctrl_c_in_generate_ends_the_line(smollm2_gguf, tmp_path):
    """The partial reply's line is closed before `lucy: error: interrupted` (exit 130)."""
    child = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "lucy",
            "generate",
            str(smollm2_gguf),
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "2000",
            "--temperature",
            "0",
        ],  # fmt: skip
        cwd=str(tmp_path),
        encoding="utf-8",
        timeout=120,
    )
    child.expect_exact("\x1b[?25h")  # the opening spinner ends (it shows the cursor again)
    child.expect(r"\w+ \w+")  # a few tokens have streamed
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    text = child.before
    assert re.search(r"\S\r?\nlucy: error: interrupted", text), repr(text[-200:])


@pytest.mark.parametrize("args", [("inspect",), ("inspect", "--json"), ("models",)])
def test_a_reader_that_left_is_a_quiet_exit_0(world, args):  # noqa: F811
    """`lucy inspect M | head`: the pipe is closed before lucy writes; exit 0, nothing on stderr
    (rich used to exit 1)."""
    argv = [args[0], str(world["snapshot"]), *args[1:]] if args[0] == "inspect" else list(args)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lucy", *argv],
        env=world["env"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read()
    assert proc.wait(timeout=240) == 0, err
    assert err == b""


def test_inspect_names_the_stored_quant_scheme(smollm2_gguf, world):  # noqa: F811
    """The Q4_1 file's matrices are held as gguf_q4_1 (types read by llama.cpp's gguf-py); the
    layers' dtype stays what they compute in."""
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(str(smollm2_gguf)).tensors}
    proc = run_lucy(world["env"], "inspect", str(smollm2_gguf), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    rows = {r["type"]: r for r in data["layers"]}
    assert rows["MultiHeadAttention"]["weights"] == "gguf_" + types["blk.0.attn_q.weight"].lower()
    assert rows["SwiGLU"]["weights"] == "gguf_" + types["blk.0.ffn_up.weight"].lower()
    assert types["blk.0.attn_norm.weight"] == "F32" and rows["RMSNorm"]["weights"] == "float32"
    every = sorted({"float32" if t == "F32" else f"gguf_{t.lower()}" for t in types.values()})
    assert data["weights"] == every  # the Q8_0 embedding table too
    assert data["dtypes"] == ["float32"]
    assert sum(data["stored"].values()) == sum(int(t.n_bytes) for t in reader_tensors(smollm2_gguf))
    table = run_lucy(world["env"], "inspect", str(smollm2_gguf)).stdout
    assert f"weights: {', '.join(every)}" in table


def reader_tensors(path):
    from gguf import GGUFReader

    return GGUFReader(str(path)).tensors


def test_inspect_reads_no_weights(smollm2_hf_dir, tmp_path):
    """`lucy inspect` of the float32 SmolLM2 snapshot (540 MB of weights) peaks far below the
    weights' size (it peaked at 1.2 GB loading them all) and counts transformers' parameters."""
    from transformers import AutoConfig, LlamaForCausalLM

    weights = (smollm2_hf_dir / "model.safetensors").stat().st_size
    probe = (
        "import resource, subprocess, sys; "
        "p = subprocess.run([sys.executable, '-m', 'lucy', 'inspect', sys.argv[1], '--json'], "
        "capture_output=True, text=True); "
        "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
        "print(p.stdout)"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(smollm2_hf_dir)], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path).stdout  # fmt: skip
    first, body = out.split("\n", 1)
    code, peak_kb = map(int, first.split())
    assert code == 0, out
    assert peak_kb * 1024 < weights / 2, (peak_kb, weights)
    data = json.loads(body)
    cfg = AutoConfig.from_pretrained(smollm2_hf_dir)
    with torch_meta():
        ref = LlamaForCausalLM(cfg).num_parameters()
    stored = sum(data["stored"].values())
    assert stored == weights - _safetensors_header(smollm2_hf_dir / "model.safetensors")
    layers = sum(r["params"] for r in data["layers"])
    table = cfg.vocab_size * cfg.hidden_size
    assert layers + table + cfg.hidden_size - zero_bias_count(cfg) == ref


def torch_meta():
    import torch

    return torch.device("meta")


def _safetensors_header(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_models_lists_the_demo_gguf(smollm2_gguf, world, tmp_path):  # noqa: F811
    """`lucy demo` keeps its GGUF in $POLY_HOME/models: `lucy models` lists it, with the
    parameter count and tensor type gguf-py reads."""
    from gguf import GGUFReader

    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    (models / smollm2_gguf.name).symlink_to(smollm2_gguf)
    env = {**world["env"], "POLY_HOME": str(tmp_path / "home")}
    proc = run_lucy(env, "models", "--json")
    assert proc.returncode == 0, proc.stderr
    row = next(r for r in json.loads(proc.stdout) if r["kind"] == "gguf")
    tensors = GGUFReader(str(smollm2_gguf)).tensors
    assert row["parameters"] == sum(int(t.n_elements) for t in tensors)
    kinds = Counter(t.tensor_type.name for t in tensors if len(t.shape) == 2)
    assert row["dtype"] == kinds.most_common(1)[0][0]
    assert row["path"] == str(models / smollm2_gguf.name) and row["supported"] is True


def test_python_m_lucy_in_a_dir_holding_a_poly_folder(world, tmp_path):  # noqa: F811
    """`python -m lucy` where POLY_HOME is ./poly: the folder must not shadow the package."""
    (tmp_path / "poly" / "entities").mkdir(parents=True)
    proc = run_lucy({**world["env"], "POLY_HOME": str(tmp_path / "poly")}, "models", "--json",
                    cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)
