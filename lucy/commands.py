"""The `lucy` subcommands: each takes the parsed arguments and returns the exit code."""

from __future__ import annotations

import json
import sys
import time

from lucy import actions, settings
from lucy.terminal import clean, make_console
from poly.errors import UsageError


def _settings_note(model, overrides: dict) -> None:
    """--verbose: the settings in use and where each came from, on stderr."""
    rows = settings.settings_in_use(model, overrides)
    print(clean(settings.settings_line(rows)), file=sys.stderr, flush=True)


def cmd_models(args) -> int:
    from lucy import catalogue, views

    rows = catalogue.list_models()
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=1))
    else:
        make_console().print(views.models_table(rows))
    return 0


def cmd_chat(args) -> int:
    from lucy.chat_ui import on_full_policy, run_chat

    overrides = settings.overrides_from_args(args)
    settings.check_overrides(overrides)  # bad values fail before the (slow) load
    spec = actions.speculation_from_args(args)
    on_full = on_full_policy(args.on_full, sys.stdin.isatty())

    def body(model, info) -> int:
        if args.verbose:
            _settings_note(model, overrides)
        speculation = actions.load_speculation(spec, model, args.kv_cache)
        return run_chat(
            model, system=args.system, overrides=overrides, on_full=on_full, speculation=speculation
        )

    return _run(args, body)


def _run(args, body) -> int:
    """`body(model, info)` on the loaded model; with --tp on rank 0 of the MPI job, each rank
    holding its shard (lucy/tp_cli.py)."""
    kv_cache = getattr(args, "kv_cache", None)
    if getattr(args, "tp", None) is not None:
        from lucy import tp_cli

        return tp_cli.run(args.tp, args.model, body, kv_cache)
    memory = getattr(args, "memory", None)
    return body(actions.load_model(args.model, args.max_experts, kv_cache, memory=memory), {})


def cmd_convert(args) -> int:
    from lucy import views

    con = make_console()
    start = time.perf_counter()
    bpw = getattr(args, "bpw", None)
    if bpw is not None:
        from entity.quantize import check_bpw

        bpw = check_bpw(bpw)  # before reading the source: a bad budget is a one-line error
    report = actions.convert_with_progress(
        con, args.src, args.dst, args.quant, args.force, args.verify,
        bpw=bpw, calibration=getattr(args, "calibration", None), to=getattr(args, "to", "entity"),
    )  # fmt: skip
    views.print_convert_report(con, report, time.perf_counter() - start)
    return 0


class _Stream:
    """Tokens to stdout as they come; remembers whether a line is open (Ctrl-C closes it)."""

    open_line = False

    def __call__(self, text: str) -> None:
        sys.stdout.write(clean(text))
        sys.stdout.flush()
        self.open_line = True


def cmd_generate(args) -> int:
    overrides = settings.overrides_from_args(args, greedy=args.greedy)
    settings.check_overrides(overrides)
    spec = actions.speculation_from_args(args)

    def body(model, info) -> int:
        if args.verbose:
            _settings_note(model, overrides)
        speculation = actions.load_speculation(spec, model, args.kv_cache)
        stream = None if args.json else _Stream()
        try:
            result = actions.generate(
                model, args.prompt, overrides, chat=args.chat, system=args.system,
                on_token=stream, speculation=speculation,
            )  # fmt: skip
        except KeyboardInterrupt:  # end the partial reply's line before "lucy: error: ..."
            if stream is not None and stream.open_line:
                print(flush=True)
            raise
        if args.json:
            print(json.dumps({**result, **info}))
        else:
            print(flush=True)
        if args.verbose and "speculative" in result:
            print(clean(actions.speculation_line(result["speculative"])), file=sys.stderr)
        return 0

    return _run(args, body)


def cmd_bench(args) -> int:
    from lucy import bench, plots, views

    if args.compare:
        if args.plot:
            raise UsageError("--plot does not apply to --compare")
        return bench.run_compare(args.model, runs=args.runs, as_json=args.json)
    if not args.model:
        raise UsageError("lucy bench needs a MODEL (or --compare)")
    if args.plot:
        plots.require(args.plot)  # before the (slow) load
    spec = actions.speculation_from_args(args)
    if args.tp is not None:
        from lucy import tp_cli

        def body(model, info) -> int:
            res = bench.bench_model(model, args.prompt_tokens, args.new_tokens, args.runs)
            res = {"model": str(args.model), **info, **res}
            if args.lengths or args.plot:
                res["sweep"] = bench.sweep(model, args.lengths, args.new_tokens, args.runs)
            res.update(tp_cli.bench_extras(model, args.new_tokens))
            if args.plot:
                plots.save(plots.bench_figure(res), args.plot)
            if args.json:
                print(json.dumps(res))
            else:
                make_console().print(views.bench_table(res))
            return 0

        return tp_cli.run(args.tp, args.model, body, args.kv_cache)
    result = bench.run_bench(
        args.model,
        args.prompt_tokens,
        args.new_tokens,
        args.runs,
        max_experts=args.max_experts,
        memory=args.memory,
        kv_cache=args.kv_cache,
        speculation=spec,
        lengths=args.lengths,
        sweep_lengths=bool(args.plot),
    )
    if args.plot:
        plots.save(plots.bench_figure(result), args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        make_console().print(views.bench_table(result))
    return 0


def cmd_eval(args) -> int:
    from lucy.evaluate import run_eval

    return run_eval(args)


def cmd_inspect(args) -> int:
    from lucy import views

    data = actions.inspect(args.model, args.max_experts, fit=args.fit, ctx=args.ctx)
    if args.json:
        print(json.dumps(data))
    else:
        views.print_inspect(make_console(), data)
    return 0


def cmd_demo(args) -> int:
    from lucy.chat_ui import on_full_policy, run_chat

    path = actions.demo_entity(make_console())
    on_full = on_full_policy(None, sys.stdin.isatty())
    return run_chat(actions.load_model(str(path)), on_full=on_full)


def cmd_download(args) -> int:
    path = actions.download(args.repo_id)
    print(f"downloaded {args.repo_id} → {path}")
    return 0


def cmd_serve(args) -> int:
    from lucy.server.run import serve

    if getattr(args, "tp", None) is not None:  # every rank: rank 0 serves (lucy/server/tp.py)
        from lucy.server import tp

        return tp.serve(args)
    return serve(args, actions.load_model)


def cmd_menu(args) -> int:
    from lucy.menu import run_menu

    return run_menu()


COMMANDS = {
    None: cmd_menu,
    "models": cmd_models,
    "chat": cmd_chat,
    "convert": cmd_convert,
    "generate": cmd_generate,
    "bench": cmd_bench,
    "eval": cmd_eval,
    "inspect": cmd_inspect,
    "demo": cmd_demo,
    "download": cmd_download,
    "serve": cmd_serve,
}
