"""`lucy` with no arguments: the numbered menu (Loom's Lucy, inventory §7).

Every prompt shows its default in brackets and Enter accepts it; unknown input re-asks; EOF on
stdin at any prompt leaves with exit 0. Errors from the library print one line and return to
the menu.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from lucy import chat_ui, cli, views
from poly.errors import PolyError
from poly.quant import schemes as quant_schemes

MAIN_MENU = (
    ("1", "Chat with a model from the HF cache"),
    ("2", "Convert to .entity and chat"),
    ("3", "Download models"),
    ("4", "Benchmark"),
    ("5", "Inspect a model"),
    ("6", "Layer test suite"),
    ("7", "Demo (SmolLM2-135M)"),
    ("0", "Quit"),
)

CURATED = (
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "HuggingFaceTB/SmolLM2-360M-Instruct",
    "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen/Qwen3-0.6B",
)

QUANT_ALIASES = quant_schemes.cli_aliases()  # menu answer -> --quant name


class MenuExit(Exception):
    """EOF on stdin: leave the menu cleanly."""


class Menu:
    def __init__(self, con: Console):
        self.con = con

    # --- prompts --------------------------------------------------------------------------------

    def ask(self, prompt: str, default: str, valid=None) -> str:
        """Ask until the answer passes `valid` (a set of strings or a predicate)."""
        while True:
            line = chat_ui.read_line(self.con, f"{prompt} [{default}]: ")
            if line is None:
                raise MenuExit
            answer = line.strip() or default
            ok = valid is None or (
                answer in valid if isinstance(valid, (set, frozenset, dict)) else valid(answer)
            )
            if ok:
                return answer
            self.con.print(f"unknown choice {chat_ui.clean(answer)!r}, try again", markup=False)

    def ask_yes(self, prompt: str, default: bool = False) -> bool:
        answer = self.ask(f"{prompt} (1/0)", "1" if default else "0", {"0", "1", "y", "n"})
        return answer in ("1", "y")

    def pick(self, rows: list[views.ModelRow], title: str) -> views.ModelRow | None:
        if not rows:
            self.con.print(f"no models found ({title}); try [3] Download or [7] Demo")
            return None
        self.con.print(views.models_table(rows, title=title))
        valid = {str(i) for i in range(1, len(rows) + 1)}
        return rows[int(self.ask("Select model number", "1", valid)) - 1]

    # --- main loop ------------------------------------------------------------------------------

    def run(self) -> int:
        actions = {
            "1": self.chat_hf,
            "2": self.entity_talk,
            "3": self.download,
            "4": self.bench,
            "5": self.inspect,
            "6": self.layer_suite,
            "7": self.demo,
        }
        try:
            while True:
                self.con.print("\n[bold]Lucy[/bold] — poly local LLM toolkit")
                for key, label in MAIN_MENU:
                    self.con.print(f"\\[{key}] {label}")
                choice = self.ask("Select", "1", {k for k, _ in MAIN_MENU})
                if choice == "0":
                    return 0
                self._guarded(actions[choice])
        except MenuExit:
            return 0

    def _guarded(self, action) -> None:
        """Library errors and Ctrl-C end the action, never the menu."""
        try:
            action()
        except PolyError as err:
            self.con.print(f"error: {chat_ui.clean(str(err))}", markup=False)
        except KeyboardInterrupt:
            self.con.print("\n(cancelled)")
        except Exception as err:  # noqa: BLE001 - a bug in one action must not kill the menu
            self.con.print(f"error: {type(err).__name__}: {chat_ui.clean(str(err))}", markup=False)

    def _load(self, path: str):
        self.con.print(f"loading {chat_ui.clean(path)} …", markup=False)
        t0 = time.perf_counter()
        model = cli.load_model(path)
        self.con.print(f"loaded in {time.perf_counter() - t0:.1f} s", style="dim")
        return model

    # --- actions --------------------------------------------------------------------------------

    def chat_hf(self) -> None:
        rows = [r for r in views.hf_rows() if r.supported]
        row = self.pick(rows, "HF cache")
        if row is not None:
            chat_ui.run_chat(self._load(row.path), con=self.con)

    def entity_talk(self) -> None:
        """Loom's ENTITY Talk: catalogue, convert some, choose quant, then chat."""
        hf = [r for r in views.hf_rows() if r.supported]
        self.con.print(catalogue_table(hf))
        picks = self._convert_choice(hf)
        if picks:
            quant = QUANT_ALIASES[self.ask("Quant (q4/q8/f16/bf16/f32)", "q4", QUANT_ALIASES)]
            force = self.ask_yes("Force reconvert?", False)
            for row in picks:
                self._convert_one(row, quant, force)
        row = self.pick(views.entity_rows(), "entities")
        if row is not None:
            chat_ui.run_chat(self._load(row.path), con=self.con)

    def _convert_choice(self, hf: list[views.ModelRow]) -> list[views.ModelRow]:
        n = len(hf)

        def valid(ans: str) -> bool:
            return ans in ("0", "a") or all(
                p.strip().isdigit() and 1 <= int(p) <= n for p in ans.split(",")
            )

        ans = self.ask("Convert: [0] skip, [a] all missing, [n] one, or a list 1,3", "0", valid)
        if ans == "0":
            return []
        if ans == "a":
            return [r for r in hf if not entity_path(r).exists()]
        return [hf[int(p) - 1] for p in ans.split(",")]

    def _convert_one(self, row: views.ModelRow, quant: str, force: bool) -> None:
        dst = entity_path(row, quant)
        dst.parent.mkdir(parents=True, exist_ok=True)
        self.con.print(f"converting {row.name} → {dst.name} [{quant}]", markup=False)
        try:
            cli.convert_with_progress(self.con, row.path, dst, quant=quant, force=force)
        except PolyError as err:
            self.con.print(f"error: {chat_ui.clean(str(err))}", markup=False)
            return
        size = dst.stat().st_size
        self.con.print(f"done: {views.human_bytes(row.size_bytes)} → {views.human_bytes(size)}")

    def download(self) -> None:
        self.con.print("[0] Download all (sequential)")
        for i, repo in enumerate(CURATED, 1):
            self.con.print(f"\\[{i}] {repo}")
        valid = {str(i) for i in range(len(CURATED) + 1)}
        ans = self.ask(
            "Select a number or type a repo id (org/name)",
            "1",
            lambda a: a in valid or a.count("/") == 1,
        )
        repos = CURATED if ans == "0" else (CURATED[int(ans) - 1],) if ans in valid else (ans,)
        for repo in repos:
            path = cli.download(repo)
            self.con.print(f"downloaded {repo} → {path}", markup=False)

    def bench(self) -> None:
        from lucy import bench

        row = self.pick(views.list_models(), "benchmark")
        if row is None:
            return
        is_num = str.isdigit
        prompt = int(self.ask("Prompt tokens", "64", lambda a: is_num(a) and int(a) > 0))
        new = int(self.ask("New tokens", "32", lambda a: is_num(a) and int(a) > 0))
        result = bench.run_bench(row.path, prompt, new, runs=3)
        self.con.print(views.bench_table({**result, "model": row.name}))

    def inspect(self) -> None:
        row = self.pick(views.list_models(), "inspect")
        if row is not None:
            views.print_inspect(self.con, views.inspect_data(self._load(row.path)))

    def layer_suite(self) -> None:
        from lucy import layer_suite

        self.con.print("running the layer suite (3 layers × 21 dtypes) …")
        self.con.print(views.layer_suite_table(layer_suite.run_suite()))

    def demo(self) -> None:
        path = cli.demo_entity(self.con)
        chat_ui.run_chat(self._load(str(path)), con=self.con)


def entity_path(row: views.ModelRow, quant: str = "q4") -> Path:
    """The `.entity` that convert, demo and the menu write for ``row`` (entity.paths' rule)."""
    from entity.paths import entities_dir, entity_filename

    return entities_dir() / entity_filename(row.path, quant)


def catalogue_table(rows: list[views.ModelRow]):
    """HF model → .entity status and sizes (Loom ENTITY Talk catalogue)."""
    from rich.table import Table

    table = Table(title="ENTITY catalogue")
    for col in ("#", "model", "support", ".entity", "HF → .entity"):
        table.add_column(col)
    for i, r in enumerate(rows, 1):
        found = [p for p in (entity_path(r, q) for q in QUANT_ALIASES.values()) if p.exists()]
        ent = found[0].name if found else "—"
        size = views.human_bytes(found[0].stat().st_size) if found else "—"
        table.add_row(
            str(i),
            chat_ui.clean(r.name),
            "yes" if r.supported else r.reason,
            ent,
            f"{views.human_bytes(r.size_bytes)} → {size}",
        )
    return table


def run_menu() -> int:
    return Menu(views.make_console()).run()
