"""``lucy serve``: load the model, build the scheduler and app, run uvicorn until SIGTERM/SIGINT.

A signal stops accepting connections, lets in-flight requests and streams finish (drain), stops
the scheduler and returns normally, so the process exits 0.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from pathlib import Path

from poly.errors import UsageError

WARN_OPEN = "lucy serve: warning: listening on {host} without --api-key: anyone on the network can use this model"


def model_names(spec: str) -> tuple[str, list[str]]:
    """The id /v1/models reports (the file or directory name) and accepted aliases."""
    p = Path(spec)
    name = p.name or spec
    for suffix in (".entity", ".gguf"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name, [spec, p.name, str(p.resolve()) if p.exists() else spec]


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, minus re-raising the signal after a graceful shutdown (exit 0)."""

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
          prefill_chunk=512, max_queue=64):  # fmt: skip
    """(FastAPI app, ServerState) for a loaded model."""
    from lucy.server.app import create_app
    from lucy.server.state import ServerState
    from poly.serving import Scheduler
    from poly.serving.kv import make_kv

    kv = make_kv(model, kv_pages=kv_pages, max_batch=max_batch, ctx=ctx)
    sched = Scheduler(model, max_batch=max_batch, prefill_chunk=prefill_chunk,
                      max_queue=max_queue, max_context=ctx, kv=kv)  # fmt: skip
    name, aliases = model_names(spec)
    state = ServerState(sched, name, aliases, api_key=api_key)
    return create_app(state), state


def serve(args, load_model) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise UsageError(
            f"lucy serve needs the serve extra: pip install 'polyloom[serve]' ({err.name} missing)"
        ) from None
    if args.max_batch < 1:
        raise UsageError("--max-batch must be >= 1")
    if args.ctx is not None and args.ctx < 2:
        raise UsageError("--ctx must be >= 2")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(WARN_OPEN.format(host=args.host), file=sys.stderr, flush=True)
    # the KV cache and RoPE tables are sized when the model loads
    ctx = {} if args.ctx is None else {"max_seq_len": args.ctx}
    model = load_model(args.model, kv_cache=getattr(args, "kv_cache", None), **ctx)
    app, state = build(model, args.model, max_batch=args.max_batch, ctx=args.ctx,
                       kv_pages=args.kv_pages, api_key=args.api_key,
                       max_queue=args.max_queue)  # fmt: skip
    import uvicorn

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=state.drain_s, access_log=False)  # fmt: skip
    print(
        f"lucy serve: {state.model_id} on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    _server_class()(config).run()
    return 0
