"""`lucy serve --tp N`: one model over N MPI ranks behind one HTTP server.

    mpiexec.gforker -n 2 python -m mpi4py -m lucy serve MODEL --tp 2   # one machine
    mpiexec -disable-auto-cleanup -hosts a,b -n 2 python -m mpi4py -m lucy serve MODEL --tp 2

Every rank loads its shard (lucy/tp_cli.py, as `lucy generate --tp`); rank 0 binds the port and
runs the HTTP server and the scheduler, whose KV calls the other ranks mirror on their own KV
heads (poly.serving.tpkv). A lost rank (killed, or silent past a collective's deadline) fails
the requests in flight and every new one with a 503, and rank 0 ends the job `GRACE` seconds
later (MPI_Abort: the other ranks go too). mpiexec.gforker's SIGINT and SIGQUIT after a rank
dies are held until then; hydra's `-disable-auto-cleanup` keeps it from killing rank 0 at once,
but its proxy may still do so (docs/parallel.md), so the clients can see a reset instead.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from poly.errors import PeerLostError, PolyError, UsageError

GRACE = 2.0  # seconds a server that lost a rank answers 503 before it stops
HARD_EXIT = 7.0  # seconds after the loss when rank 0 ends the job whatever is still running
LOAD_TIMEOUT = 600.0  # seconds a follower waits for rank 0 to load and build its KV store


def serve(args) -> int:
    from lucy import tp_cli
    from lucy.server import run

    run.check_args(args)
    if getattr(args, "memory", None) is not None:
        raise UsageError("--memory does not run with --tp yet: give --ctx and --kv-pages")
    if getattr(args, "max_experts", None) is not None:
        raise UsageError("--max-experts does not run with --tp (MoE layers are not split yet)")
    for flag in ("lookup", "draft", "slot_dir", "slots"):  # their KV calls are not mirrored yet
        if getattr(args, flag, None) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} does not run with --tp yet")
    comm = tp_cli.world_of(args.tp, args.model)
    # every collective from here on is bounded (their blocking and non-blocking forms do not
    # match each other: the ranks switch together)
    comm.timeout = LOAD_TIMEOUT
    sock = None
    try:
        if comm.rank == 0:
            if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
                print(run.WARN_OPEN.format(host=args.host), file=sys.stderr, flush=True)
            sock = run.bind(args.host, args.port)
        model = _load(args, comm)
        if comm.rank:
            return _follow(model, comm)
        return _lead(args, model, comm, sock)
    except (PolyError, Exception) as err:
        raise tp_cli.rank_error(comm, err) from err
    finally:
        if sock is not None:
            sock.close()


def _load(args, comm):
    import entity
    from lucy import tp_cli

    tp_cli.set_rank_threads(comm)
    ctx = {} if args.ctx is None else {"max_seq_len": args.ctx}
    model = entity.load(args.model, tp=comm, lockstep=True, **ctx)
    if getattr(args, "kv_cache", None) is not None:
        model.kv_cache_dtype = args.kv_cache
    model.following = True  # the logits of every step are gathered to rank 0 only
    return model


def _follow(model, comm) -> int:
    from poly.serving import tpkv

    for s in (signal.SIGINT, signal.SIGTERM):  # rank 0 leads the shutdown (its "stop")
        signal.signal(s, signal.SIG_IGN)
    shape = comm.bcast(None)
    if shape is None:  # rank 0 failed before serving: its error is the one shown
        return 0
    tpkv.peers(comm)  # rank 0's watchdog learns this process
    kv = tpkv.build_like(model, shape)
    try:
        tpkv.follow(kv, comm)
    except PeerLostError as err:  # rank 0 is gone: nobody will end this process but itself
        print(f"lucy: error: rank {comm.rank} of {comm.size}: {err}", file=sys.stderr, flush=True)
        os._exit(err.exit_code)  # not MPI_Finalize: it would wait for the dead rank
    return 0


def _lead(args, model, comm, sock) -> int:
    from lucy.server import run
    from poly.serving import tpkv
    from poly.serving.kv import make_kv

    try:
        run.check_ctx(model, args.ctx)
        inner = make_kv(model, kv_pages=args.kv_pages, max_batch=args.max_batch, ctx=args.ctx)
    except Exception:
        comm.bcast(None)  # the followers return; this rank's error ends the job
        raise
    comm.bcast(tpkv.shape_of(inner))
    held: dict = {}
    lead = tpkv.LeadKV(inner, comm, on_lost=lambda reason: _on_lost(held, comm, reason))
    lead.warm()

    def on_server(server, state) -> None:
        held.update(server=server, state=state)
        server.hold_exit = lambda: lead.rank_lost() is not None

    # mpiexec.gforker follows its SIGINT with SIGQUIT when a rank dies: the lost-rank path ends
    # the job itself (GRACE, then MPI_Abort with its one line)
    signal.signal(signal.SIGQUIT, lambda *_: _quit_unless_lost(lead))
    try:
        code = run.run_app(args, model, sock, kv=lead, on_server=on_server)
    finally:
        lead.finish()
    if lead.lost is not None:
        _end_job(comm, lead.lost)
    return code


def _quit_unless_lost(lead) -> None:
    if lead.rank_lost() is None:  # SIGQUIT's own default: end the process
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGQUIT)


def _on_lost(held: dict, comm, reason: str) -> None:
    """Every request from now on is a 503; the server stops after GRACE seconds and the job
    ends by HARD_EXIT whatever still runs."""
    state, server = held.get("state"), held.get("server")
    if state is not None:
        state.draining = True
        state.down = f"unavailable: {reason}"
    if server is not None:
        threading.Timer(GRACE, lambda: setattr(server, "should_exit", True)).start()
    hard = threading.Timer(HARD_EXIT, _end_job, (comm, reason))
    hard.daemon = True
    hard.start()


def _end_job(comm, reason: str) -> None:
    """One line, then MPI_Abort: the other ranks end too (a dead one never finalizes)."""
    err = PeerLostError(reason)
    print(f"lucy: error: {err}", file=sys.stderr, flush=True)
    try:
        comm.abort(err.exit_code)
    finally:
        os._exit(err.exit_code)
