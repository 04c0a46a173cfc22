"""What lucy does, shared by the subcommands and the menu: load, convert, download, demo, and
one streamed generation. No argparse and no menu here; output goes to the console passed in."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from lucy.terminal import opening, progress_bar
from poly.errors import ModelNotFoundError, NoNetworkError, OutputExistsError, UsageError

DEMO_QUANT = "q4"  # the demo file: entity.paths.entity_filename(GGUF, DEMO_QUANT)
NETWORK_TIMEOUT_S = 3.0  # connect check before a download: no network fails in seconds
# Safe files only: never pickled *.bin / *.pt weights.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


def load_model(
    spec: str,
    max_experts: int | None = None,
    kv_cache: str | None = None,
    memory: str | None = None,
    **kw,
):
    """Any checkpoint via `entity.load` (``kw``: its options); ``max_experts`` pages an MoE
    model's experts under that resident budget; ``kv_cache`` "f16" halves the KV cache;
    ``memory`` ("6G"): the budget and context that fit it (`entity.fit`), from the headers."""
    import entity

    if memory is not None:
        max_experts, kw["max_seq_len"] = _fit_memory(spec, memory, max_experts, kv_cache, kw)
    try:
        with opening(spec):
            model = entity.load(spec, max_resident_experts=max_experts, **kw)
    except ModelNotFoundError as err:
        raise _with_hint(err, str(spec)) from None
    if kv_cache is not None:
        model.kv_cache_dtype = kv_cache
    return model


def _fit_memory(spec: str, memory: str, max_experts, kv_cache, kw) -> tuple[int | None, int]:
    from entity.fit import parse_size, plan

    if max_experts is not None:
        raise UsageError("give --memory or --max-experts, not both")
    try:
        got, _ = plan(spec, parse_size(memory), kw.get("max_seq_len"), kv_cache)
    except ModelNotFoundError as err:
        raise _with_hint(err, str(spec)) from None
    return got.max_resident, got.ctx


def inspect(
    spec: str, max_experts: int | None = None, fit: str | None = None, ctx: int | None = None
) -> dict:
    """`lucy inspect`'s report from the checkpoint's headers (no weights are read), or from the
    loaded model when an expert budget is asked for (its pager reports) or the file is a Loom
    v1 `.entity` (only its full reader parses it). ``fit`` ("8G"): will it fit, at ``ctx``
    tokens of context (`entity.fit`: from the headers too)."""
    from entity.load import describe
    from lucy import views

    if fit is not None:
        from entity.fit import parse_size, plan

        if ctx is not None and ctx < 1:
            raise UsageError(f"--ctx must be >= 1, got {ctx}")
        try:
            got, fp = plan(spec, parse_size(fit, "--fit"), ctx)
        except ModelNotFoundError as err:
            raise _with_hint(err, str(spec)) from None
        data = inspect(spec, max_experts)
        data["fit"] = views.fit_data(got, fp)
        return data
    if max_experts is None:
        try:
            desc = describe(spec)
        except ModelNotFoundError as err:
            raise _with_hint(err, str(spec)) from None
        if desc is not None:
            return views.describe_data(desc)
    return views.inspect_data(load_model(spec, max_experts))


def _with_hint(err: ModelNotFoundError, spec: str) -> ModelNotFoundError:
    """A model id that is not in the cache: say how to get it (lucy owns the command name)."""
    if type(err) is not ModelNotFoundError or Path(spec).expanduser().exists():
        return err
    org, _, name = spec.partition("/")
    if org and name and "/" not in name and not spec.startswith((".", "~")):
        hint = f"download it with `lucy download {spec}`"
    else:
        hint = "no such file, and not an org/name model id"
    return ModelNotFoundError(f"{err.message}; {hint}", path=err.path)


def convert_with_progress(
    con, src, dst=None, quant="q4", force=False, verify=False, generation=None, *,
    bpw=None, calibration=None, to="entity",
):  # fmt: skip
    """Run `entity.convert` under a rich progress bar; returns its report."""
    import entity

    with progress_bar(con) as bar:
        task = bar.add_task(f"converting {Path(str(src)).name}", total=None)

        def progress(done, total, detail=""):
            bar.update(task, completed=done, total=total, description=f"{detail}"[:40])

        try:
            return entity.convert(
                src, dst, quant=quant, force=force, verify=verify, progress=progress,
                generation=generation, calibrate=quant == "q4", bpw=bpw, calibration=calibration,
                to=to,
            )  # fmt: skip
        except OutputExistsError as err:  # the library names its keyword; lucy names its flag
            raise OutputExistsError(
                "output exists (use --force to overwrite)", path=err.path
            ) from None


def demo_entity(con) -> Path:
    """SmolLM2 GGUF → q4 .entity in the entity dir carrying the demo's generation settings
    (entity.smollm2.DEMO_GENERATION), converted once and reused (a demo file from an older
    version, without them, is converted again)."""
    from entity.paths import entities_dir, entity_filename
    from entity.smollm2 import DEMO_GENERATION, GGUF_NAME, ensure_smollm2, has_demo_generation

    dst = entities_dir() / entity_filename(GGUF_NAME, DEMO_QUANT)
    if not dst.exists() or not has_demo_generation(dst):
        gguf = ensure_smollm2()
        dst.parent.mkdir(parents=True, exist_ok=True)
        con.print(f"converting {gguf.name} → {dst} (once)")
        convert_with_progress(
            con, gguf, dst, quant=DEMO_QUANT, force=dst.exists(), generation=DEMO_GENERATION
        )
    return dst


def check_network(repo_id: str) -> None:
    """One quick connect to the Hub's host; `NoNetworkError` within NETWORK_TIMEOUT_S if none."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise NoNetworkError(
            f"no network: offline mode (HF_HUB_OFFLINE) so cannot download {repo_id}"
        )
    url = urlparse(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    if not _reachable(url.hostname or "", port):
        raise NoNetworkError(
            f"no network: cannot reach {url.scheme}://{url.netloc} to download {repo_id}"
        )


def _reachable(host: str, port: int) -> bool:
    """A TCP connect within NETWORK_TIMEOUT_S, name lookup included (a thread bounds a resolver
    that would otherwise hang)."""
    ok: list[bool] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=NETWORK_TIMEOUT_S).close()
            ok.append(True)
        except OSError:
            pass

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(NETWORK_TIMEOUT_S)
    return bool(ok)


def download(repo_id: str) -> Path:
    """Snapshot a repo into the HF cache; any connection failure is one `NoNetworkError`."""
    from huggingface_hub import errors as hf
    from huggingface_hub import snapshot_download

    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise UsageError(f"not a valid repo id: {repo_id!r} (expected org/name)")
    check_network(repo_id)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS))
    except hf.HFValidationError:
        raise UsageError(f"not a valid repo id: {repo_id!r}") from None
    except (hf.RepositoryNotFoundError, hf.RevisionNotFoundError):
        raise ModelNotFoundError(f"{repo_id} not found on the Hub (or gated)") from None
    except (hf.LocalEntryNotFoundError, OSError, hf.HfHubHTTPError):
        raise NoNetworkError(f"no network: cannot download {repo_id}") from None


def prompt_ids(model, prompt: str, *, chat: bool, system: str | None) -> list[int]:
    """The one tokenization of a prompt: `Transformer.prompt_ids` (as `model.generate` does)."""
    return model.prompt_ids(prompt, chat=chat or system is not None, system=system)


def speculation_from_args(args) -> dict | None:
    """--lookup / --draft / --draft-tokens as `generate` keywords (the draft still a path),
    checked before any load: a `SpeculationError` (exit 2) names the flag."""
    from poly.errors import SpeculationError
    from poly.text.speculative import Speculation

    lookup, draft = getattr(args, "lookup", None), getattr(args, "draft", None)
    n = getattr(args, "draft_tokens", None)
    if lookup is None and draft is None and n is None:
        return None
    if n is not None and draft is None:
        raise SpeculationError("--draft-tokens needs --draft MODEL")
    if lookup is not None and draft is not None:
        raise SpeculationError("--lookup and --draft: choose one way to propose tokens")
    if getattr(args, "tp", None) is not None:
        raise UsageError("--lookup and --draft do not run with --tp yet")
    try:
        Speculation(lookup=lookup, draft=None if draft is None else object(), draft_tokens=n)
    except SpeculationError as err:
        text = str(err).replace("draft_tokens ", "--draft-tokens ").replace("lookup ", "--lookup ")
        raise SpeculationError(text) from None
    return {"lookup": lookup, "draft": draft, "draft_tokens": n}


def load_speculation(spec: dict | None, model, kv_cache: str | None = None) -> dict:
    """The checked flags as `generate` keywords, the draft loaded and checked against ``model``
    (same vocabulary and tokenizer, else `SpeculationError`)."""
    if not spec:
        return {}
    out = {k: v for k, v in spec.items() if v is not None}
    if out.get("draft") is not None:
        from poly.text.speculative import check_draft

        out["draft"] = load_model(str(out["draft"]), kv_cache=kv_cache)
        check_draft(model, out["draft"])
    return out


def speculation_line(report: dict) -> str:
    """`--verbose`'s line: how many proposals were kept and tokens per target pass."""
    return (
        f"speculative ({report['mode']}): accepted {report['accepted']}/{report['proposed']} "
        f"({100 * report['acceptance_rate']:.1f} %) · {report['tokens_per_pass']:.2f} tok/pass "
        f"· {report['passes']} passes"
    )


def generate(
    model, prompt: str, overrides: dict, *, chat=False, system=None, on_token=None, speculation=None
):
    """One completion through `model.stream` (the library's prompt and options path); calls
    `on_token(text)` for each token as it arrives; returns the `lucy generate --json` dict.
    ``speculation``: `load_speculation`'s keywords."""
    from poly.text.generation import DoneEvent

    ids = prompt_ids(model, prompt, chat=chat, system=system)
    done, out_ids = None, []
    for event in model.stream(ids, **overrides, **(speculation or {})):
        if isinstance(event, DoneEvent):
            done = event
        else:
            out_ids.append(int(event.token_id))
            if on_token is not None:
                on_token(event.text)
    return done_json(done, ids, out_ids)


def _count(x) -> int:
    return len(x) if isinstance(x, (list, tuple)) else int(x)


def done_json(done, prompt_ids, out_ids) -> dict:
    return {
        "text": done.text,
        "tokens": out_ids,
        "prompt_tokens": _count(done.prompt_tokens),
        "prompt_ids": [int(t) for t in prompt_ids],
        "prefill_tokens": int(done.prefill_tokens),
        "prefill_s": float(done.prefill_s),
        "decode_s": float(done.decode_s),
        "prefill_tok_s": float(done.prefill_tok_s),
        "decode_tok_s": float(done.decode_tok_s),
        "stop_reason": str(done.stop_reason),
        **({"experts": done.experts} if getattr(done, "experts", None) else {}),
        **({"speculative": done.speculative} if getattr(done, "speculative", None) else {}),
    }
