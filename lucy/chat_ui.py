"""The interactive chat loop over `poly.text.session.ChatSession` (slash commands, streamed replies).

Input is read with `sys.stdin.readline` so the loop works the same in a terminal and with piped
stdin; model text is written raw (control characters stripped) and flushed token by token.
"""

from __future__ import annotations

import sys

from lucy.settings import SET_PARSERS, settings_in_use, settings_line
from lucy.terminal import clean, make_console, read_line
from poly.errors import ContextOverflowError, PolyError, UsageError

HELP = """commands:
  /reset            forget the conversation (keeps the system message)
  /system TEXT      set the system message (resets the conversation)
  /set NAME VALUE   temperature, top_k, top_p, max_tokens, seed
  /save FILE        save the conversation and its KV cache to FILE
  /load FILE        restore a conversation saved by /save (same model) and continue it
  /stats            last prefill and decode speed, tokens in cache, settings in use
  /help             this text
  /quit             leave the chat (Ctrl-C or EOF at the prompt too)"""

# --- the loop -----------------------------------------------------------------------------------


def footer(done) -> str:
    """The one-line stats after a reply (tests read "prefill N tok")."""
    spec = getattr(done, "speculative", None)
    extra = (
        f" · accepted {100 * spec['acceptance_rate']:.0f} % · {spec['tokens_per_pass']:.2f} tok/pass"
        if spec
        else ""
    )
    return (
        f"prefill {int(done.prefill_tokens)} tok @ {done.prefill_tok_s:.1f} tok/s · "
        f"decode {_count(done.tokens)} tok @ {done.decode_tok_s:.1f} tok/s · {done.stop_reason}"
        + extra
    )


def _count(x) -> int:
    return len(x) if isinstance(x, (list, tuple)) else int(x)


class ChatUI:
    """Reads user lines, runs slash commands, streams replies of one `ChatSession`."""

    def __init__(self, session, con, out=None, overrides: dict | None = None, on_full="ask"):
        if on_full not in ON_FULL:
            raise UsageError(f"on_full must be one of {', '.join(ON_FULL)}, got {on_full!r}")
        self.session = session
        self.con = con
        self.out = out or sys.stdout
        self.on_full = on_full  # what a full context does: ask, drop-oldest or stop
        self.exit_code = 0  # 8 when `stop` ended the chat on a full context
        self.last = None  # DoneEvent of the last reply
        self.overrides = dict(overrides or {})  # flags and /set values: shown as "flag"

    def run(self) -> None:
        self.con.print("[dim]chat: /help for commands, /quit to leave[/dim]")
        while True:
            try:
                line = read_line(self.con, "you> ")
            except KeyboardInterrupt:
                self.con.print()
                return
            if line is None or not self.handle(line.strip()) or self.exit_code:
                return

    def handle(self, line: str) -> bool:
        """Run one input line; False leaves the chat."""
        if not line:
            return True
        if not line.startswith("/"):
            self.reply(line)
            return True
        name, _, rest = line.partition(" ")
        action = COMMANDS.get(name)
        if action is None:
            self.con.print(f"unknown command {clean(name)!r}; /help lists them", markup=False)
            return True
        try:
            return action(self, rest.strip()) is not False
        except PolyError as err:
            self.con.print(f"error: {err}", markup=False)
            return True

    def reply(self, text: str) -> None:
        while True:
            try:
                self._stream(text)
                return
            except ContextOverflowError as err:
                if not self._offer_drop(err):
                    return
            except PolyError as err:
                self.con.print(f"\nerror: {err}", markup=False)
                return

    def _stream(self, text: str) -> None:
        from poly.text.generation import DoneEvent, TokenEvent

        events = self.session.send(text)
        started = False
        try:
            for event in events:
                if isinstance(event, TokenEvent):
                    if not started:
                        self.out.write("bot> ")
                        started = True
                    self.out.write(clean(event.text))
                    self.out.flush()
                elif isinstance(event, DoneEvent):
                    self.last = event
                    self.out.write("\n")
                    self.out.flush()
                    self.con.print(footer(event), style="dim", markup=False)
        except KeyboardInterrupt:
            self.out.write("\n")
            self.con.print("[dim](stopped)[/dim]")
        finally:
            if hasattr(events, "close"):
                events.close()

    def _offer_drop(self, err) -> bool:
        """True to retry the message after dropping the oldest turn, per `on_full`."""
        self.con.print(f"context full: {err}", markup=False)
        history = getattr(self.session, "history", None) or []
        if not any(m.get("role") == "user" for m in history):
            self.con.print("no earlier turns to drop: shorten the message", markup=False)
            return self._stop()
        if self.on_full == "stop":
            return self._stop()
        if self.on_full == "ask":
            answer = read_line(self.con, "drop the oldest turn and retry? (1/0) [1]: ")
            if answer is None or answer.strip() not in ("", "1", "y", "yes"):
                return False
        try:
            self.session.drop_oldest_turns(1)
        except PolyError as exc:
            self.con.print(f"cannot drop turns: {exc}", markup=False)
            return False
        return True

    def _stop(self) -> bool:
        if self.on_full == "stop":  # a script must notice: the chat ends with exit code 8
            self.con.print("message not sent; chat ended (--on-full stop)", markup=False)
            self.exit_code = 8
        return False


ON_FULL = ("ask", "drop-oldest", "stop")


def on_full_policy(choice: str | None, interactive: bool) -> str:
    """`--on-full`: asking needs a terminal; a piped chat never reads its next line as an answer
    (default there: stop)."""
    if choice is None:
        return "ask" if interactive else "stop"
    if choice == "ask" and not interactive:
        raise UsageError("--on-full ask needs an interactive terminal; use drop-oldest or stop")
    return choice


def _cmd_reset(ui: ChatUI, rest: str) -> None:
    ui.session.reset()
    ui.con.print("[dim]conversation reset[/dim]")


def _cmd_system(ui: ChatUI, rest: str) -> None:
    ui.session.set_system(rest or None)
    ui.con.print("[dim]system message set[/dim]")


def _cmd_set(ui: ChatUI, rest: str) -> None:
    name, _, value = rest.partition(" ")
    parse = SET_PARSERS.get(name)
    if parse is None or not value.strip():
        raise UsageError(f"usage: /set NAME VALUE with NAME in {', '.join(SET_PARSERS)}")
    try:
        parsed = parse(value.strip())
    except ValueError as exc:
        raise UsageError(f"{name}: {value.strip()!r} is not a valid {parse.__name__}") from exc
    ui.session.set_option(name, parsed)
    ui.overrides[name] = parsed
    ui.con.print(f"[dim]{name} = {parsed}[/dim]")


def _cmd_stats(ui: ChatUI, rest: str) -> None:
    """Each number once: the last reply's speeds, the cache, then the settings in use."""
    s = ui.session
    cached = getattr(getattr(s, "model", None), "position", None)
    parts = [f"last prefill {getattr(s, 'last_prefill_tokens', None)} tok"]
    if ui.last is not None:
        parts.append(f"prefill {ui.last.prefill_tok_s:.1f} tok/s")
        parts.append(f"decode {ui.last.decode_tok_s:.1f} tok/s")
    parts.append(f"tokens in cache {cached}")
    parts.append(f"turns {getattr(s, 'turns', 0)}")
    ui.con.print(" · ".join(parts), markup=False)
    model = getattr(s, "model", None)
    rows = settings_in_use(model, ui.overrides)
    ui.con.print(clean(settings_line(rows)), markup=False, style="dim")


def _state_path(rest: str, name: str):
    from pathlib import Path

    if not rest:
        raise UsageError(f"usage: {name} FILE")
    return Path(rest).expanduser()


def _cmd_save(ui: ChatUI, rest: str) -> None:
    path = _state_path(rest, "/save")
    size = ui.session.save(path)
    cached = ui.session.model.position
    ui.con.print(f"saved {cached} cached tokens to {path} ({size / 1e6:.1f} MB)", markup=False)


def _cmd_load(ui: ChatUI, rest: str) -> None:
    turns = ui.session.load(_state_path(rest, "/load"))
    cached = ui.session.model.position
    ui.con.print(f"loaded {turns} turns, {cached} cached tokens", markup=False)


def _cmd_help(ui: ChatUI, rest: str) -> None:
    ui.con.print(HELP, markup=False)


def _cmd_quit(ui: ChatUI, rest: str) -> bool:
    return False


COMMANDS = {
    "/reset": _cmd_reset,
    "/system": _cmd_system,
    "/set": _cmd_set,
    "/stats": _cmd_stats,
    "/save": _cmd_save,
    "/load": _cmd_load,
    "/help": _cmd_help,
    "/quit": _cmd_quit,
    "/exit": _cmd_quit,
}


def run_chat(
    model, system: str | None = None, overrides: dict | None = None, con=None, on_full="ask",
    speculation: dict | None = None,
) -> int:  # fmt: skip
    """Open a `ChatSession` on `model` and run the loop until /quit, Ctrl-C or EOF; the exit
    code (8 when `on_full="stop"` ended it). ``speculation``: `generate` keywords (lookup=,
    draft=, draft_tokens=) for every reply."""
    from poly.text.session import ChatSession
    from poly.text.speculative import Speculation

    con = con or make_console()
    spec = Speculation.from_options(dict(speculation or {}))
    session = ChatSession(model, system=system, label="flag", speculation=spec, **(overrides or {}))
    ui = ChatUI(session, con, overrides=overrides, on_full=on_full)
    ui.run()
    return ui.exit_code
