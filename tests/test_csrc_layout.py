"""Issue #57's rules for the C kernels (csrc/), checked on the tree itself.

- No C file over 400 lines.
- No circles: no two C files use names defined in each other, directly or through others. The
  check is two facts that together imply it: the `#include "..."` graph of csrc/ has no cycle,
  and every name a file uses that another csrc/ file defines (macros, functions, variables,
  types, enum members; found by a scan of file-scope declarations) is defined in a file it
  includes, directly or not. If A uses B's names, B is in A's include closure; the graph being
  acyclic, A is then not in B's, so B cannot use A's. A prototype of a static function defined
  elsewhere would dodge the scan, so none is allowed.
- Every header compiles alone (`cc -fsyntax-only`, the build's flags per instruction set): it
  includes what it uses. base and avx512 are slow (pytest --slow); avx2 runs by default.
- Every stored format is named in at most 3 C files: core/common.h (the kind ids), its own file
  (its record and every piece of code that knows its bytes) and the dispatch table
  formats/kinds.h (kind -> record); the kernels read the record's fields.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
MAX_LINES = 400
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
ISA_FLAGS = {
    "base": [],
    "avx2": AVX2,
    "avx512": [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni"],
}
# the stored formats (csrc/core/common.h's kinds without the dense ones)
FORMATS = ("BF16", "LOOM_Q4", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q2_K",
           "Q3_K", "Q5_K", "IQ4_NL", "IQ4_XS", "MXFP4")  # fmt: skip
KEYWORDS = {"if", "for", "return", "else", "do", "while", "switch", "case", "default", "goto",
            "break", "continue", "sizeof", "struct", "enum", "union"}  # fmt: skip
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
IDENT = re.compile(r"[A-Za-z_]\w*")


def c_files() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in {".c", ".h"})


def code(path: Path) -> str:
    """The file without comments and string/char literals (line count kept)."""
    src = path.read_text()
    src = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), src, flags=re.S)
    src = re.sub(r"//[^\n]*", "", src)
    src = re.sub(r'"(\\.|[^"\\\n])*"', '""', src)
    return re.sub(r"'(\\.|[^'\\\n])*'", "''", src)


def prototypes(src: str, static: bool = True) -> set[str]:
    """Functions declared at file scope without a body: `static T name(...);` (or any, the
    extern ones too: module.c's declarations of the ISA builds' makers)."""
    head = r"^static\b" if static else r"^(?!typedef)[A-Za-z_]"
    return set(re.findall(head + r"[^;{}=]*?\b(\w+)\s*\([^;{}]*\)\s*;", src, re.M))


def defined(src: str) -> set[str]:
    """Names defined at file scope: macros, functions, variables, typedefs, enum members."""
    names = set(re.findall(r"^\s*#\s*define\s+(\w+)", src, re.M))
    src = re.sub(r"__attribute__\s*\(\(.*?\)\)", "", src)
    for line in src.splitlines():
        if not re.match(r"[A-Za-z_]", line) or re.match(r"\w+:\s*$", line):
            continue
        if line.split()[0] in KEYWORDS or line.startswith("typedef struct"):
            continue
        m = re.match(r"typedef\s[^;(]*?\(\s*\*\s*(\w+)\s*\)", line)  # function pointer type
        m = m or re.match(r"[^;(=\[{]*?\b(\w+)\s*[(=\[;{]", line)
        if m:
            names.add(m.group(1))
    names |= set(re.findall(r"^\}\s*(\w+)\s*;", src, re.M))  # typedef struct {...} name;
    for m in re.finditer(r"\benum\s*\w*\s*\{([^}]*)\}", src):
        names |= set(re.findall(r"(\w+)\s*(?:=[^,]*)?(?:,|$)", m.group(1)))
    bodies = set(re.findall(r"^[A-Za-z_][^;{}=]*?\b(\w+)\s*\([^;{}]*\)\s*\{", src, re.M))
    return names - KEYWORDS - (prototypes(src, static=False) - bodies)


def rel(p: Path) -> str:
    return p.relative_to(CSRC).as_posix()


def include_graph() -> dict[str, set[str]]:
    graph = {}
    for p in c_files():
        deps = set()
        for name in INCLUDE.findall(p.read_text()):
            for base in (p.parent, CSRC):  # "x.h" beside the file, or from csrc/ (-Icsrc)
                if (base / name).is_file():
                    deps.add(rel((base / name).resolve()))
                    break
        graph[rel(p)] = deps
    return graph


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for d in graph.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def test_no_c_file_over_400_lines():
    long = {rel(p): n for p in c_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_include_graph_has_no_cycle():
    graph = include_graph()
    cycles = sorted(f for f in graph if f in closure(graph, f))
    assert cycles == []


def test_no_prototype_of_a_function_defined_elsewhere():
    srcs = {rel(p): code(p) for p in c_files()}
    found = {f: sorted(prototypes(s) - defined(s)) for f, s in srcs.items()}
    assert {f: names for f, names in found.items() if names} == {}


def used(src: str) -> set[str]:
    """Identifiers a file uses that it may take from another: not struct members (`->n`, `.n`),
    not names it declares itself as locals or parameters (`T name =`, `T *name[`, `T name)`)."""
    names = set(IDENT.findall(re.sub(r"(->|\.)\s*\w+", " ", src)))
    local = set(re.findall(r"(?:\w|\*)\s+\**(\w+)\s*(?:=|\[|;|,|\))", src))
    return names - local


def test_names_come_only_from_included_files():
    """Every name a file takes from another csrc/ file is defined in its include closure."""
    graph, srcs = include_graph(), {rel(p): code(p) for p in c_files()}
    defs = {f: defined(s) for f, s in srcs.items()}
    owners: dict[str, set[str]] = {}
    for f, names in defs.items():
        for n in names:
            owners.setdefault(n, set()).add(f)
    wrong = {}
    for f, s in srcs.items():
        reach = closure(graph, f)
        for name in used(s) - defs[f]:
            where = owners.get(name, set())
            if where and not where & reach:
                wrong.setdefault(f, []).append(f"{name} ({', '.join(sorted(where))})")
    assert wrong == {}


def compile_alone(header: Path, flags: list[str]) -> str:
    cmd = ["cc", "-fsyntax-only", "-x", "c", "-O3", "-fopenmp", "-Wall", "-Wundef", "-Werror"]
    cmd += ["-Wno-unused-function", "-Wno-unused-variable", "-Wno-unused-but-set-variable"]
    cmd += [f"-I{CSRC}", f"-I{sysconfig.get_paths()['include']}", "-DPK_MAKER=pk_make_test"]
    run = subprocess.run([*cmd, *flags, str(header)], capture_output=True, text=True, timeout=120)
    return "" if run.returncode == 0 else run.stderr.strip().splitlines()[0]


@pytest.mark.parametrize(
    "isa",
    [pytest.param("base", marks=pytest.mark.slow), "avx2",
     pytest.param("avx512", marks=pytest.mark.slow)],
)  # fmt: skip
def test_every_header_compiles_alone(isa):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip("no Python.h (python3-dev)")
    headers = [p for p in c_files() if p.suffix == ".h"]
    with ThreadPoolExecutor(4) as pool:
        errors = dict(
            zip(map(rel, headers), pool.map(lambda h: compile_alone(h, ISA_FLAGS[isa]), headers))
        )
    assert {h: e for h, e in errors.items() if e} == {}


def files_naming(fmt: str) -> list[str]:
    word = re.compile(rf"(?<![A-Za-z0-9]){fmt}(?![A-Za-z0-9])")
    return [rel(p) for p in c_files() if word.search(code(p))]


def test_a_format_is_named_in_at_most_three_files():
    many = {f: n for f in FORMATS if len(n := files_naming(f)) > 3}
    assert many == {}
