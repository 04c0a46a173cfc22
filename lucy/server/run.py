"""``lucy serve``: load the model, build the scheduler and app, run uvicorn until SIGTERM/SIGINT.

A signal stops accepting connections, lets in-flight requests and streams finish (drain), stops
the scheduler and returns normally, so the process exits 0.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from poly.errors import UsageError

MAX_CTX = 1 << 24  # the largest max_seq_len a model file may declare (poly.config)
WARN_OPEN = "lucy serve: warning: listening on {host} without --api-key: anyone on the network can use this model"


def model_names(spec: str) -> tuple[str, list[str]]:
    """The id /v1/models reports (the file or directory name) and accepted aliases."""
    p = Path(spec)
    name = p.name or spec
    for suffix in (".entity", ".gguf"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name, [spec, p.name, str(p.resolve()) if p.exists() else spec]


def _server_class(banner: str):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, minus re-raising the signal after a graceful shutdown (exit 0);
        prints ``banner`` once it listens."""

        # asked on SIGINT/SIGTERM: True keeps serving (a TP server that lost a rank answers 503
        # until it stops itself; mpiexec.gforker sends the others SIGINT when a rank dies)
        hold_exit = None

        def handle_exit(self, sig, frame):
            if self.hold_exit is not None and self.hold_exit():
                return
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                print(banner, file=sys.stderr, flush=True)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    return Server


def build(model, spec: str, *, max_batch=16, ctx=None, kv_pages=None, api_key=None,
          prefill_chunk=512, max_queue=64, body_timeout=None, kv=None, opts=None,
          draft=None):  # fmt: skip
    """(FastAPI app, ServerState) for a loaded model (`kv`: a KV store made already; `opts`:
    the parsed `lucy serve` options lucy/server/extras.py reads, `draft` the --draft model)."""
    from lucy.server import extras
    from lucy.server.app import create_app
    from lucy.server.state import ServerState
    from poly.serving import Scheduler
    from poly.serving.kv import make_kv

    if kv is None:
        kv = make_kv(model, kv_pages=kv_pages, max_batch=max_batch, ctx=ctx)
    check_memory(model, kv, ctx or model.config.max_seq_len)
    name, aliases = model_names(spec)
    kv, speculation = extras.setup(opts, model, kv, name, draft)
    sched = Scheduler(model, max_batch=max_batch, prefill_chunk=prefill_chunk,
                      max_queue=max_queue, max_context=ctx, kv=kv, spec=speculation)  # fmt: skip
    timeout = {} if body_timeout is None else {"body_timeout": body_timeout}
    state = ServerState(sched, name, aliases, api_key=api_key, **timeout)
    app = create_app(state)
    extras.attach(app, state, opts)
    return app, state


def check_args(args) -> None:
    """Start-up options that would leave every request failing: refused before the load."""
    if args.max_batch < 1:
        raise UsageError("--max-batch must be >= 1")
    if args.ctx is not None and not 2 <= args.ctx <= MAX_CTX:
        raise UsageError(f"--ctx must be in 2..{MAX_CTX} (the largest context a loader accepts)")
    if args.max_queue < 1:
        raise UsageError(f"--max-queue must be >= 1, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    if args.kv_pages is not None and args.kv_pages < 0:
        raise UsageError(f"--kv-pages must be >= 0, got {args.kv_pages}")
    check_max_connections(getattr(args, "max_connections", None))
    from lucy.server.extras import check

    check(args)
    for flag in ("header_timeout", "body_timeout"):
        value = getattr(args, flag, 1.0)
        if not (value > 0 and math.isfinite(value)):
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive number of seconds")


def check_max_connections(n: int | None) -> None:
    """--max-connections past the open-file limit would fail accepts with EMFILE instead."""
    from lucy.server.limits import FD_HEADROOM, fd_room

    if n is None:
        return
    if n < 1:
        raise UsageError(f"--max-connections must be >= 1, got {n}")
    if n > (room := fd_room()):
        raise UsageError(f"--max-connections {n} exceeds the {room} connections the open-file "
                         f"limit leaves (ulimit -n less {FD_HEADROOM}): lower it or raise "
                         "ulimit -n")  # fmt: skip


def check_ctx(model, ctx: int | None) -> None:
    """--ctx beyond the context the model was trained for (as its file states it)."""
    trained = (getattr(model, "source", None) or {}).get("context_length")
    if ctx is not None and isinstance(trained, int) and 0 < trained < ctx:
        raise UsageError(f"--ctx {ctx} exceeds the model's context length {trained}")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def check_memory(model, kv, ctx: int) -> None:
    """The KV store must hold one full context, and fit in the machine's memory."""
    from entity.fit import KV_ITEM
    from poly.nn.mha import kv_dtype

    def item(a) -> float:  # a q8_0 cache (int8 codes) holds a float16 scale per 32 values too
        return KV_ITEM["q8_0"] if kv_dtype(a).itemsize == 1 else kv_dtype(a).itemsize

    per_token = round(sum(2 * a.num_kv_heads * a.head_dim * item(a)
                          for a in (model.attn(i) for i in range(model.config.num_layers))))  # fmt: skip
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if getattr(kv, "paged", False):
        pool = kv.pool.n_pages * kv.page_bytes
        if kv.pool.n_pages * kv.ps < ctx:
            raise UsageError(
                f"--ctx {ctx} needs {_gib(ctx * per_token)} of KV cache for one sequence; the "
                f"pool holds {kv.pool.n_pages * kv.ps} positions ({_gib(pool)}): lower --ctx "
                "or raise --kv-pages"
            )
    else:
        pool = ctx * per_token  # contiguous caches: one full sequence at least
    if pool > ram:
        raise UsageError(f"the KV cache needs {_gib(pool)}, the machine has {_gib(ram)}: "
                         "lower --ctx or --kv-pages")  # fmt: skip


def bind(host: str, port: int) -> socket.socket:
    """The listening socket's address taken now, so a busy port is one line and exit 2 and the
    port printed is the one bound (--port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is fine
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is in use") from None
        reason = err.strerror or str(err)
        raise UsageError(f"cannot listen on {host} port {port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


def _log_handler(level: str) -> None:
    """The request lines of lucy.server.app.RequestLog, in uvicorn's own format."""
    from uvicorn.logging import DefaultFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s", use_colors=None))
    logger = logging.getLogger("lucy.server")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper() if level != "trace" else logging.DEBUG)
    logger.propagate = False


def serve(args, load_model) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise UsageError(
            f"lucy serve needs the serve extra: pip install 'polyloom[serve]' ({err.name} missing)"
        ) from None
    check_args(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(WARN_OPEN.format(host=args.host), file=sys.stderr, flush=True)
    sock = bind(args.host, args.port)
    try:
        return _serve(args, load_model, sock)
    finally:
        sock.close()


def _serve(args, load_model, sock: socket.socket) -> int:
    # the KV cache and RoPE tables are sized when the model loads
    ctx = {} if args.ctx is None else {"max_seq_len": args.ctx}
    memory = getattr(args, "memory", None)
    model = load_model(args.model, getattr(args, "max_experts", None),
                       kv_cache=getattr(args, "kv_cache", None), memory=memory, **ctx)  # fmt: skip
    kv_pages = args.kv_pages
    if memory is not None and kv_pages is None:  # the budget holds one context of KV (entity.fit)
        kv_pages = -(-model.config.max_seq_len // 16)
    from lucy.server.extras import load_draft

    draft = load_draft(args, load_model, max_seq_len=model.config.max_seq_len)
    return run_app(args, model, sock, kv_pages=kv_pages, draft=draft)


def run_app(args, model, sock: socket.socket, kv=None, kv_pages=None, on_server=None,
            draft=None) -> int:  # fmt: skip
    """Serve the loaded `model` on `sock` until a signal; `on_server(server, state)` sees the
    uvicorn server and the state before it runs (lucy/server/tp.py stops it on a lost rank)."""
    check_ctx(model, args.ctx)
    app, state = build(model, args.model, max_batch=args.max_batch, ctx=args.ctx,
                       kv_pages=kv_pages, api_key=args.api_key, max_queue=args.max_queue,
                       body_timeout=getattr(args, "body_timeout", None), kv=kv, opts=args,
                       draft=draft)  # fmt: skip
    if getattr(args, "verbose", False):  # as `lucy generate --verbose` prints them
        from lucy import settings

        per_request = ("max_tokens", "seed")
        rows = [r for r in settings.settings_in_use(model, {}) if r[0] not in per_request]
        print(f"lucy serve: {settings.settings_line(rows)}", file=sys.stderr, flush=True)
    import uvicorn

    from lucy.server.limits import HEAD_TIMEOUT, MAX_HEAD, default_max_connections, protocol

    head_timeout = getattr(args, "header_timeout", HEAD_TIMEOUT)
    max_conn = getattr(args, "max_connections", None) or default_max_connections()
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False,
                            http=protocol(MAX_HEAD, head_timeout, max_conn),
                            timeout_graceful_shutdown=state.drain_s)  # fmt: skip
    _log_handler(args.log_level)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    banner = f"lucy serve: {state.model_id} on http://{shown}:{port}"
    server = _server_class(banner)(config)
    if on_server is not None:
        on_server(server, state)
    server.run(sockets=[sock])
    return 0
