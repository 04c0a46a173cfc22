"""#12/#13 on the `lucy` surface: one prompt path with the library, streaming, menu dead ends and
the exact one-line messages (with their exit codes) a new user meets."""

from __future__ import annotations

import json
import re
import sys

import pexpect
import pytest

from lucy import bench, cli, settings
from poly.errors import EXIT_CODES
from tests.test_lucy_cli import lucy, one_error_line, world  # noqa: F401 - shared fixture

USAGE = 2


def usage_code() -> int:
    assert EXIT_CODES[USAGE]  # the documented code of a usage error
    return USAGE


# --- one prompt path ----------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True])
def test_generate_matches_library_generate(world, chat):  # noqa: F811
    """`lucy generate --greedy --json` and `entity.load(m).generate(X, greedy)`: same prompt ids
    (= the HF tokenizer's, special tokens included) and the same tokens."""
    from transformers import AutoTokenizer

    import entity

    text = "The capital of France is"
    flags = ["--chat"] if chat else []
    proc = lucy(world, "generate", str(world["snapshot"]), "--prompt", text, "--greedy", "--json",
                *flags)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    model = entity.load(str(world["snapshot"]))
    done = model.generate(text, chat=chat, **settings.GREEDY)  # what --greedy passes
    assert got["tokens"] == [int(t) for t in done.tokens]
    assert got["prompt_tokens"] == (
        len(done.prompt_tokens) if isinstance(done.prompt_tokens, list) else done.prompt_tokens
    )
    tok = AutoTokenizer.from_pretrained(world["src"])
    if chat:
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        want = tok(rendered, add_special_tokens=False)["input_ids"]
    else:
        want = tok(text)["input_ids"]  # add_special_tokens=True, as transformers does
    assert got["prompt_ids"] == want


def test_verbose_prints_settings_and_their_source(world):  # noqa: F811
    proc = lucy(world, "generate", str(world["snapshot"]), "--prompt", "hi", "--max-tokens", "2",
                "--verbose")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("settings: ")]
    assert len(lines) == 1, proc.stderr
    assert "max_tokens=2 (flag)" in lines[0] and "(model file)" in lines[0]


def test_generate_streams_before_the_last_token(smollm2_gguf, tmp_path):
    """The first text reaches the terminal while the process is still generating."""
    env = {"POLY_HOME": str(tmp_path), "NO_COLOR": "1", "PATH": "/usr/bin:/bin"}
    env.update({k: v for k, v in __import__("os").environ.items() if k.startswith("PYTHON")})
    args = ["-m", "lucy", "generate", str(smollm2_gguf), "--prompt", "Write a long story.",
            "--chat", "--greedy", "--max-tokens", "200"]  # fmt: skip
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=300)
    child.expect(r"\S")  # the first token
    first = child.before + child.after
    assert child.isalive(), "all output came at once"
    child.expect(pexpect.EOF)
    rest = child.before
    child.close()
    assert child.exitstatus == 0
    assert len(rest.strip()) > len(first.strip())


# --- argparse -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "typo,line",
    [
        (["--promt", "hi"], "unrecognized argument --promt; did you mean --prompt?"),
        (
            ["--prompt", "hi", "--max-token", "5"],
            "unrecognized argument --max-token; did you mean --max-tokens?",
        ),  # fmt: skip
        (["--prompt", "hi", "--zzzz"], "unrecognized argument --zzzz"),
    ],
)
def test_unknown_flag_names_the_closest(world, typo, line):  # noqa: F811
    proc = lucy(world, "generate", str(world["snapshot"]), *typo)
    assert one_error_line(proc) == f"lucy: error: {line} (see 'lucy generate --help')"
    assert proc.returncode == usage_code()


def test_subcommand_error_points_at_its_help(world):  # noqa: F811
    proc = lucy(world, "chat")
    assert one_error_line(proc) == (
        "lucy: error: the following arguments are required: model (see 'lucy chat --help')"
    )
    assert proc.returncode == usage_code()


def test_every_option_has_help_and_its_default():
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    for name, sub in subs.choices.items():
        assert not sub.allow_abbrev
        for action in sub._actions:
            assert action.help, f"lucy {name} {action.dest}: no help text"
    text = subs.choices["convert"].format_help()
    assert "(default: q4)" in " ".join(text.split())
    text = " ".join(subs.choices["generate"].format_help().split())
    assert "(default: the model file's setting, else the fallback)" in text


# --- messages -----------------------------------------------------------------------------------


def test_missing_model_is_one_plain_line(world):  # noqa: F811
    proc = lucy(world, "generate", "no-such-org/no-such-model", "--prompt", "hi")
    line = one_error_line(proc)
    hub = str(world["base"] / "hf" / "hub")
    assert line == (
        f"lucy: error: 'no-such-org/no-such-model' is not a local path and not in the HF cache; "
        f"download it with `lucy download no-such-org/no-such-model` [{hub}]"
    )
    assert proc.returncode == 3 and "Error" not in line


def test_convert_onto_existing_names_only_the_flag(world):  # noqa: F811
    out = world["base"] / "exists2.entity"
    out.write_bytes(b"keep me")
    proc = lucy(world, "convert", str(world["snapshot"]), "-o", str(out))
    assert one_error_line(proc) == f"lucy: error: output exists (use --force to overwrite) [{out}]"
    assert out.read_bytes() == b"keep me"


def test_download_offline_is_one_line(world):  # noqa: F811
    proc = lucy(world, "download", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert one_error_line(proc) == (
        "lucy: error: no network: offline mode (HF_HUB_OFFLINE) so cannot download "
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )


def test_bench_compare_without_peers_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(bench, "PEERS", {"no_such_module_xyz": "llama-cpp-python"})
    assert cli.run(["bench", "--compare"]) == usage_code()
    err = capsys.readouterr().err
    assert err == (
        "lucy: error: lucy bench --compare needs llama-cpp-python: pip install 'polyloom[bench,test]'\n"
    )


# --- the menu -----------------------------------------------------------------------------------


def _menu(world, keys: str, env=None):  # noqa: F811
    import subprocess

    return subprocess.run([sys.executable, "-m", "lucy"], env=env or world["env"], input=keys,
                          capture_output=True, text=True, timeout=240, cwd=world["base"])  # fmt: skip


def test_converted_file_shows_in_menu_catalogue_and_chat_list(world):  # noqa: F811
    proc = lucy(world, "convert", world["snapshot"].parts[-3].replace("models--", "").replace(
        "--", "/"), "--quant", "q8")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    name = "test-org--tiny-llama.q8.entity"
    menu = _menu(world, "2\n0\n")  # catalogue, convert nothing, then EOF at the pick
    row = next(ln for ln in menu.stdout.splitlines() if "test-org/tiny-llama" in ln)
    assert name in row
    menu = _menu(world, "1\n")  # [1]: the .entity file and the HF model, then EOF
    assert "test-org--tiny-llama.q8" in menu.stdout and "test-org/tiny-llama" in menu.stdout
    assert menu.returncode == 0


def test_menu_convert_with_empty_cache_says_why(world, tmp_path):  # noqa: F811
    env = {**world["env"], "HF_HOME": str(tmp_path / "hf"), "POLY_HOME": str(tmp_path / "p")}
    menu = _menu(world, "2\n", env)
    hub = tmp_path / "hf" / "hub"
    lines = [ln.removeprefix("Select [1]: ") for ln in menu.stdout.splitlines()]  # no echo
    assert (
        f"nothing to convert: no supported model in the HF cache ({hub}); try [3] Download "
        "([1] chats with .entity files)" in lines
    )
    assert menu.stdout.count("Select [1]: ") == 2  # straight back to the menu, then EOF
    assert "ENTITY catalogue" not in menu.stdout and menu.returncode == 0


def test_menu_download_without_network_is_one_line(world):  # noqa: F811
    env = {**world["env"], "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens on port 9
    env.pop("HF_HUB_OFFLINE")
    menu = _menu(world, "3\n1\n", env)
    want = ("error: no network: cannot reach http://127.0.0.1:9 to download "
            "HuggingFaceTB/SmolLM2-135M-Instruct")  # fmt: skip
    lines = [re.sub(r"^.*\]: ", "", ln) for ln in menu.stdout.splitlines()]  # prompts: no echo
    assert [ln for ln in lines if ln.startswith("error")] == [want]
    assert menu.returncode == 0


def test_network_check_is_bounded():
    from lucy import actions

    assert actions.NETWORK_TIMEOUT_S <= 3  # fails within 5 s even when nothing answers


def test_ctrl_c_at_menu_prompt_leaves_quietly(world):  # noqa: F811
    child = pexpect.spawn(sys.executable, ["-m", "lucy"], env={**world["env"], "TERM": "xterm"},
                          cwd=str(world["base"]), encoding="utf-8", timeout=120)  # fmt: skip
    child.expect(re.escape("Select [1]: "))
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert "error" not in child.before and "Traceback" not in child.before
    assert child.exitstatus == 130


def test_stats_prints_each_number_once(world):  # noqa: F811
    import io

    from rich.console import Console

    import entity
    from lucy.chat_ui import ChatUI
    from poly.text.session import ChatSession

    model = entity.load(str(world["snapshot"]))
    out, log = io.StringIO(), io.StringIO()
    session = ChatSession(model, options=settings.options_in_use(model, {"max_tokens": 3}))
    ui = ChatUI(session, Console(file=log, width=200), out=out, overrides={"max_tokens": 3})
    assert ui.handle("hello")
    before = len(log.getvalue().splitlines())
    assert ui.handle("/stats")
    lines = log.getvalue().splitlines()[before:]
    assert len(lines) == 2, lines  # one line of numbers (each once), one of settings
    pattern = (
        r"last prefill \d+ tok · prefill [\d.]+ tok/s · decode [\d.]+ tok/s · "
        r"tokens in cache \d+ · turns 1"
    )
    assert re.fullmatch(pattern, lines[0]), lines[0]
    assert lines[1].startswith("settings: ") and "max_tokens=3 (flag)" in lines[1]
