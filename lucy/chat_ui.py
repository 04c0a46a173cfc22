"""The interactive chat loop over `poly.text.session.ChatSession`, plus option helpers.

Input is read with `sys.stdin.readline` so the loop works the same in a terminal and with piped
stdin; model text is written raw (control characters stripped) and flushed token by token.
"""

from __future__ import annotations

import dataclasses
import re
import sys

from poly.errors import ContextOverflowError, PolyError, UsageError

# `/set NAME VALUE` parsers; names are GenOptions fields.
SET_PARSERS = {"temperature": float, "top_k": int, "top_p": float, "max_tokens": int, "seed": int}

# --greedy: plain argmax, every logit processor switched off (fields absent from GenOptions skipped).
GREEDY = {
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "no_repeat_ngram": 0,
    "banned_tokens": (),
    "min_tokens": 0,
    "deterministic": True,
}

HELP = """commands:
  /reset            forget the conversation (keeps the system message)
  /system TEXT      set the system message (resets the conversation)
  /set NAME VALUE   temperature, top_k, top_p, max_tokens, seed
  /stats            last prefill, tok/s, tokens in cache
  /help             this text
  /quit             leave the chat (Ctrl-C or EOF at the prompt too)"""

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x9b]")


def clean(text: str) -> str:
    """Drop terminal control characters (ESC sequences from model or metadata text)."""
    return _CONTROL.sub("", text)


# --- options ------------------------------------------------------------------------------------


def options_dict(opts) -> dict:
    if dataclasses.is_dataclass(opts):
        return {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
    if hasattr(opts, "model_dump"):
        return opts.model_dump()
    return dict(vars(opts))


def sampling_overrides(args, greedy: bool = False) -> dict:
    """The sampling flags the user actually gave (None = keep the model's default)."""
    names = ("temperature", "top_k", "top_p", "seed", "max_tokens")
    out = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if greedy:
        out = {**GREEDY, **{k: v for k, v in out.items() if k != "temperature"}}
    return out


def make_options(base, overrides: dict):
    """`GenOptions` = model defaults (or library defaults) updated by `overrides`, validated."""
    from poly.text.sampling import GenOptions

    known = options_dict(GenOptions())
    data = dict(known) if base is None else options_dict(base)
    data.update({k: v for k, v in overrides.items() if k in known})
    return GenOptions(**data)


def check_options(overrides: dict) -> None:
    make_options(None, overrides)  # raises SamplingParamsError on a bad value


# --- one-shot generation ------------------------------------------------------------------------


def generate_once(model, prompt: str, overrides: dict, chat=False, system=None) -> dict:
    """Generate one completion; returns the JSON-able result of `lucy generate --json`."""
    from poly.text.generation import DoneEvent, stream_tokens

    if chat or system is not None:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": prompt}
        ]
        text = model.chat_template.render(messages, add_generation_prompt=True)
    else:
        text = prompt
    ids = list(model.tokenizer.encode(text))
    options = make_options(getattr(model, "generation_defaults", None), overrides)
    done, out_ids = None, []
    for event in stream_tokens(model, ids, options):
        if isinstance(event, DoneEvent):
            done = event
        else:
            out_ids.append(int(event.token_id))
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
    }


def footer(done) -> str:
    """The one-line stats after a reply (tests read "prefill N tok")."""
    return (
        f"prefill {int(done.prefill_tokens)} tok @ {done.prefill_tok_s:.1f} tok/s · "
        f"decode {_count(done.tokens)} tok @ {done.decode_tok_s:.1f} tok/s · {done.stop_reason}"
    )


# --- input --------------------------------------------------------------------------------------


def read_line(con, prompt: str) -> str | None:
    """Show `prompt` and read one line from stdin; None at EOF."""
    con.print(prompt, end="", markup=False, highlight=False)
    con.file.flush()
    line = sys.stdin.readline()
    if line == "":
        con.print()
        return None
    return line.rstrip("\r\n")


# --- the loop -----------------------------------------------------------------------------------


class ChatUI:
    """Reads user lines, runs slash commands, streams replies of one `ChatSession`."""

    def __init__(self, session, con, out=None):
        self.session = session
        self.con = con
        self.out = out or sys.stdout
        self.last = None  # DoneEvent of the last reply

    def run(self) -> None:
        self.con.print("[dim]chat: /help for commands, /quit to leave[/dim]")
        while True:
            try:
                line = read_line(self.con, "you> ")
            except KeyboardInterrupt:
                self.con.print()
                return
            if line is None or not self.handle(line.strip()):
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
        self.con.print(f"context full: {err}", markup=False)
        history = getattr(self.session, "history", None) or []
        if not any(m.get("role") == "user" for m in history):
            self.con.print("no earlier turns to drop: shorten the message", markup=False)
            return False
        answer = read_line(self.con, "drop the oldest turn and retry? (1/0) [1]: ")
        if answer is None or answer.strip() not in ("", "1", "y", "yes"):
            return False
        try:
            self.session.drop_oldest_turns(1)
        except PolyError as exc:
            self.con.print(f"cannot drop turns: {exc}", markup=False)
            return False
        return True


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
    ui.con.print(f"[dim]{name} = {parsed}[/dim]")


def _cmd_stats(ui: ChatUI, rest: str) -> None:
    s = ui.session
    cached = getattr(getattr(s, "model", None), "position", None)
    parts = [f"last prefill {getattr(s, 'last_prefill_tokens', None)} tok"]
    if ui.last is not None:
        parts.append(f"prefill {ui.last.prefill_tok_s:.1f} tok/s")
        parts.append(f"decode {ui.last.decode_tok_s:.1f} tok/s")
    parts.append(f"tokens in cache {cached}")
    ui.con.print(" · ".join(parts), markup=False)
    stats = getattr(s, "stats", None)
    if isinstance(stats, dict) and stats:
        text = " ".join(
            f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()
        )
        ui.con.print(clean(text), markup=False, style="dim")


def _cmd_help(ui: ChatUI, rest: str) -> None:
    ui.con.print(HELP, markup=False)


def _cmd_quit(ui: ChatUI, rest: str) -> bool:
    return False


COMMANDS = {
    "/reset": _cmd_reset,
    "/system": _cmd_system,
    "/set": _cmd_set,
    "/stats": _cmd_stats,
    "/help": _cmd_help,
    "/quit": _cmd_quit,
    "/exit": _cmd_quit,
}


def run_chat(model, system: str | None = None, overrides: dict | None = None, con=None) -> None:
    """Open a `ChatSession` on `model` and run the loop until /quit, Ctrl-C or EOF."""
    from lucy.views import make_console
    from poly.text.session import ChatSession

    con = con or make_console()
    options = make_options(getattr(model, "generation_defaults", None), overrides or {})
    session = ChatSession(model, system=system, options=options)
    ChatUI(session, con).run()
