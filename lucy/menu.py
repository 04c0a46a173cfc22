"""`lucy` with no arguments: the numbered menu (Loom's Lucy, inventory §7).

Every prompt shows its default in brackets and Enter accepts it; unknown input re-asks; EOF on
stdin at any prompt leaves with exit 0; a model list offers [0] to go back to the menu. Errors
from the library print one line and return to the menu.
"""

from __future__ import annotations

import time

from rich.console import Console

from lucy import actions, catalogue, views
from lucy.catalogue import QUANT_ALIASES, ModelRow
from lucy.chat_ui import run_chat
from lucy.terminal import clean, human_bytes, make_console, read_line
from poly.errors import PolyError

MAIN_MENU = (
    ("1", "Chat with a model (.entity files and the HF cache)"),
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


class MenuExit(Exception):
    """EOF on stdin: leave the menu cleanly."""


class Menu:
    def __init__(self, con: Console):
        self.con = con

    # --- prompts --------------------------------------------------------------------------------

    def ask(self, prompt: str, default: str, valid=None) -> str:
        """Ask until the answer passes `valid` (a set of strings or a predicate)."""
        while True:
            line = read_line(self.con, f"{prompt} [{default}]: ")
            if line is None:
                raise MenuExit
            answer = line.strip() or default
            ok = valid is None or (
                answer in valid if isinstance(valid, (set, frozenset, dict)) else valid(answer)
            )
            if ok:
                return answer
            self.con.print(f"unknown choice {clean(answer)!r}, try again", markup=False)

    def ask_yes(self, prompt: str, default: bool = False) -> bool:
        answer = self.ask(f"{prompt} (1/0)", "1" if default else "0", {"0", "1", "y", "n"})
        return answer in ("1", "y")

    def pick(self, rows: list[ModelRow], title: str) -> ModelRow | None:
        if not rows:
            self.con.print(
                f"no models found in the HF cache ({catalogue.hf_cache_dir()}) or the .entity "
                f"dir ({_entities_dir()}); try [3] Download or [7] Demo",
                markup=False,
            )
            return None
        self.con.print(views.models_table(rows, title=title))
        self.con.print("\\[0] back to the menu")
        valid = {str(i) for i in range(len(rows) + 1)}
        answer = int(self.ask("Select model number", "1", valid))
        return rows[answer - 1] if answer else None

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
        except KeyboardInterrupt:  # Ctrl-C at a menu prompt: leave quietly
            self.con.print()
            return 130

    def _guarded(self, action) -> None:
        """Library errors and Ctrl-C end the action, never the menu."""
        try:
            action()
        except MenuExit:  # EOF inside an action leaves the menu too, not "error: MenuExit"
            raise
        except PolyError as err:
            self.con.print(f"error: {clean(str(err))}", markup=False)
        except KeyboardInterrupt:
            self.con.print("\n(cancelled)")
        except Exception as err:  # noqa: BLE001 - a bug in one action must not kill the menu
            self.con.print(f"error: {type(err).__name__}: {clean(str(err))}", markup=False)

    def _load(self, path: str):
        self.con.print(f"loading {clean(path)} …", markup=False)
        t0 = time.perf_counter()
        model = actions.load_model(path)
        self.con.print(f"loaded in {time.perf_counter() - t0:.1f} s", style="dim")
        return model

    # --- actions --------------------------------------------------------------------------------

    def chat_hf(self) -> None:
        rows = catalogue.entity_rows() + [r for r in catalogue.hf_rows() if r.supported]
        row = self.pick(rows, "local models")
        if row is not None:
            run_chat(self._load(row.path), con=self.con)

    def entity_talk(self) -> None:
        """Loom's ENTITY Talk: catalogue, convert some, choose quant, then chat."""
        hf = [r for r in catalogue.hf_rows() if r.supported]
        if not hf:  # nothing to do here: back to the menu ([1] chats with .entity files)
            self.con.print(
                f"nothing to convert: no supported model in the HF cache "
                f"({catalogue.hf_cache_dir()}); try [3] Download ([1] chats with .entity files)",
                markup=False,
            )
            return
        self.con.print(views.catalogue_table(hf))
        picks = self._convert_choice(hf)
        if picks:
            quant = QUANT_ALIASES[self.ask("Quant (q4/q8/f16/bf16/f32)", "q4", QUANT_ALIASES)]
            force = self.ask_yes("Force reconvert?", False)
            for row in picks:
                self._convert_one(row, quant, force)
        row = self.pick(catalogue.entity_rows(), ".entity files")
        if row is not None:
            run_chat(self._load(row.path), con=self.con)

    def _convert_choice(self, hf: list[ModelRow]) -> list[ModelRow]:
        n = len(hf)

        def valid(ans: str) -> bool:
            return ans in ("0", "a") or all(
                p.strip().isdigit() and 1 <= int(p) <= n for p in ans.split(",")
            )

        ans = self.ask("Convert: [0] skip, [a] all missing, [n] one, or a list 1,3", "0", valid)
        if ans == "0":
            return []
        if ans == "a":
            return [r for r in hf if not catalogue.converted(r)]
        return [hf[int(p) - 1] for p in ans.split(",")]

    def _convert_one(self, row: ModelRow, quant: str, force: bool) -> None:
        dst = catalogue.entity_path(row, quant)
        dst.parent.mkdir(parents=True, exist_ok=True)
        self.con.print(f"converting {row.name} → {dst.name} [{quant}]", markup=False)
        try:
            actions.convert_with_progress(self.con, row.path, dst, quant=quant, force=force)
        except PolyError as err:
            self.con.print(f"error: {clean(str(err))}", markup=False)
            return
        size = dst.stat().st_size
        self.con.print(f"done: {human_bytes(row.size_bytes)} → {human_bytes(size)}")

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
            path = actions.download(repo)
            self.con.print(f"downloaded {repo} → {path}", markup=False)

    def bench(self) -> None:
        from lucy import bench

        row = self.pick(catalogue.list_models(), "benchmark")
        if row is None:
            return
        is_num = str.isdigit
        prompt = int(self.ask("Prompt tokens", "64", lambda a: is_num(a) and int(a) > 0))
        new = int(self.ask("New tokens", "32", lambda a: is_num(a) and int(a) > 0))
        result = bench.run_bench(row.path, prompt, new, runs=3)
        self.con.print(views.bench_table({**result, "model": row.name}))

    def inspect(self) -> None:
        row = self.pick(catalogue.list_models(), "inspect")
        if row is not None:
            views.print_inspect(self.con, actions.inspect(row.path))

    def layer_suite(self) -> None:
        from lucy import layer_suite

        self.con.print("running the layer suite (3 layers × 21 dtypes) …")
        self.con.print(views.layer_suite_table(layer_suite.run_suite()))

    def demo(self) -> None:
        path = actions.demo_entity(self.con)
        run_chat(self._load(str(path)), con=self.con)


def _entities_dir():
    from entity.paths import entities_dir

    return entities_dir()


def run_menu() -> int:
    return Menu(make_console()).run()
