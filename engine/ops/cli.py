"""The ``rollout`` command.

Log tools (``replay``, ``archive``, ``retention``, ``tail``, ``status``, ``pool``, ``top``,
``view``) take settings flags generated from ``engine.settings``; ``events`` and ``env``
print the generated references. A misspelt ``ROLLOUT_*`` variable is refused naming its close
matches. Process commands parse their own flags: the engine's processes run through the
entry points the top layer passes in (``workers.cli``), ``tinylm`` and ``demo`` from
``engine.ops``. Exit status: 0 ok, 1 the operation failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

from engine.errors import ConfigError, EngineError
from engine.events.log import EventLog
from engine.events.names import StreamNames
from engine.events.redis_log import open_log
from engine.settings import CONNECTION, Flags, Settings

__all__ = ["main"]

Entry = Callable[[list[str]], int]
"""A command's ``main(argv)``: its exit status."""

PROCESS_COMMANDS: dict[str, str] = {
    "worker": "an evaluator worker process",
    "finalizer": "a finalizer process",
    "capture": "a teacher capture process",
    "scheduler": "a scheduler process",
    "sync": "the weight syncer (quiesce, load, verify, resume)",
    "serve": "model servers kept at the active policy version, registered on rl:control",
}

_DELEGATES: dict[str, str] = {
    **PROCESS_COMMANDS,
    "tinylm": "the tiny SGLang-compatible model (init/serve)",
    "demo": "a whole rollout on embedded defaults",
}


def _delegate(
    command: str, argv: list[str], processes: Mapping[str, Entry], rollout: Sequence[str]
) -> int:
    if command == "tinylm":
        from engine.ops.tinylm import main as tinylm

        return int(tinylm(argv) or 0)
    if command == "demo":
        from engine.ops.demo import main as demo

        return demo(argv, rollout=rollout)
    entry = processes.get(command)
    if entry is None:
        print(
            f"error: 'rollout {command}' runs {_DELEGATES[command]}: start it with the "
            f"rollout command (or python -m workers {command})",
            file=sys.stderr,
        )
        return 2
    return int(entry(argv) or 0)


def _stream_id(text: str) -> str:
    ms, dash, seq = text.partition("-")
    if not ms.isdigit() or (dash and not seq.isdigit()):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a stream id: expected <ms>-<seq> such as 1700000000000-0 "
            f"(`rollout pool` prints the latest as 'pool at ID'; `cause=` fields of "
            f"`rollout tail` name others as stream@ID)"
        )
    return text


LOG_TOOL = Flags(CONNECTION)

_FLAGS = {
    "retention": Flags(
        (*CONNECTION, "retention_store", "retention_keep_s", "retention_dead_max"),
        aliases={"retention_store": "--store", "retention_keep_s": "--keep-s"},
    ),
    "view": Flags((*CONNECTION, "model_dir")),  # its tokenizer shows each token's text
}


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout", description="Event-sourced rollout engine for agentic RL."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        _FLAGS.get(name, LOG_TOOL).add_to(p, settings)
        return p

    p = command("replay", "rebuild a rollout's outputs")
    p.add_argument("rollout_id", metavar="ID")
    p.add_argument("--from", dest="source", type=Path, help="an archive file instead of Redis")
    p.add_argument("--out", type=Path, help="output directory (default ./replay-ID)")
    p = command("archive", "write a rollout's events to a file")
    p.add_argument("rollout_id", metavar="ID")
    p.add_argument("--out", type=Path, required=True)
    p = command(
        "retention",
        "trim acked shared streams; archive finished rollouts to files, then delete them",
    )
    p.add_argument(
        "--every",
        type=float,
        default=None,
        help="repeat every this many seconds (default: one pass, then exit)",
    )
    p = command("tail", "print live events")
    p.add_argument("--rollout", help="only this rollout's events (and its stream)")
    p.add_argument("--stream", action="append", default=[], help="a stream name to follow")
    p.add_argument("--from-start", action="store_true", help="print existing events first")
    p.add_argument("--count", type=int, help="exit after this many lines")
    p = command("status", "a rollout's progress")
    p.add_argument("rollout_id", metavar="ID")
    p = command("pool", "the placement pool now, or as it was at a past event (time travel)")
    p.add_argument(
        "--at", metavar="ID", type=_stream_id, help="an rl:pool event id (default: the latest)"
    )
    p = command("top", "a live view of rollouts, pool use, workers and lag")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    p.add_argument("--rollouts", type=int, default=8, help="most recent rollouts shown")
    p = command("view", "the rollouts, timelines and samples in the browser (read-only)")
    p.add_argument("--from", dest="source", type=Path, help="an archive file instead of Redis")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=8765, help="port (0: any free one)")
    p = sub.add_parser("env", help="every ROLLOUT_* variable: type, default, flag, meaning")
    p.add_argument(
        "--markdown", action="store_true", help="as the Markdown table of docs/configuration.md"
    )
    p = sub.add_parser("events", help="the events reference, generated from the catalog")
    p.add_argument("--markdown", action="store_true", help="as Markdown (docs/events.md)")
    p.add_argument("--out", type=Path, help="write it to this file instead of stdout")
    for name, what in _DELEGATES.items():
        sub.add_parser(name, help=f"run {what} (flags: rollout {name} --help)", add_help=False)
    return parser


@contextlib.asynccontextmanager
async def _log(settings: Settings, block_ms: int = 2000) -> AsyncIterator[EventLog]:
    # Credentials and TLS files come from ROLLOUT_REDIS_*, never argv.
    log = open_log(
        settings.redis(block_ms=block_ms),
        names=StreamNames(settings.stream_prefix),
        producer="cli",
    )
    try:
        yield log
    finally:
        await log.aclose()


async def _replay(settings: Settings, args: argparse.Namespace) -> int:
    from engine.ops.replay import (
        decode_entries,
        raw_entries,
        read_archive,
        replay_state,
        replay_to_dir,
    )

    if args.source is not None:
        archive = read_archive(args.source)
        if archive.rollout_id != args.rollout_id:
            print(
                f"error: {args.source} archives rollout {archive.rollout_id}, "
                f"not {args.rollout_id}",
                file=sys.stderr,
            )
            return 2
        stream, entries = archive.stream, archive.entries
    else:
        async with _log(settings) as log:
            stream = log.names.rollout(args.rollout_id)
            entries = await raw_entries(log, stream)
        if not entries:
            print(f"error: no events for rollout {args.rollout_id} in {stream}", file=sys.stderr)
            return 1
    envelopes, bad = decode_entries(stream, entries)
    state = replay_state(envelopes)
    out = args.out or Path(f"replay-{args.rollout_id}")
    written = replay_to_dir(state, out)
    for name, path in written.items():
        print(f"{name}: {path}")
    skipped = f", {bad} undecodable skipped" if bad else ""
    print(f"replayed {len(envelopes)} events of rollout {args.rollout_id}{skipped}")
    return 0


async def _archive(settings: Settings, args: argparse.Namespace) -> int:
    from engine.ops.replay import archive_rollout

    async with _log(settings) as log:
        n = await archive_rollout(log, args.rollout_id, args.out)
    print(f"archived {n} events of rollout {args.rollout_id} to {args.out}")
    return 0


async def _retention(settings: Settings, args: argparse.Namespace) -> int:
    from engine.ops.retention import retention_pass

    if settings.retention_store is None:
        print(
            "error: rollout retention needs --store DIR (or ROLLOUT_RETENTION_STORE)",
            file=sys.stderr,
        )
        return 2
    if args.every is not None and args.every <= 0:
        print(f"error: --every must be positive, got {args.every}", file=sys.stderr)
        return 2
    async with _log(settings) as log:
        while True:
            report = await retention_pass(
                log, settings.retention_store, keep_s=settings.retention_keep_s,
                dead_max=settings.retention_dead_max,
            )
            print(report.summary(), flush=True)
            if args.every is None:
                return 0
            await asyncio.sleep(args.every)


async def _tail(settings: Settings, args: argparse.Namespace) -> int:
    from engine.ops.inspection import tail

    async with _log(settings, block_ms=1000) as log:
        names = log.names
        streams = list(args.stream) or [names.control, names.pool, names.capture, names.dead]
        if not args.stream:
            streams.extend(await log.list_streams(names.work_pattern))
        if args.rollout:
            streams.append(names.rollout(args.rollout))
        await tail(
            log,
            sorted(set(streams)),
            emit=lambda line: print(line, flush=True),
            rollout_id=args.rollout,
            from_start=args.from_start,
            count=args.count,
        )
    return 0


async def _status(settings: Settings, args: argparse.Namespace) -> int:
    from engine.ops.inspection import last_stall, status_lines
    from engine.ops.replay import decode_entries, raw_entries
    from engine.projections.base import fold, start
    from engine.projections.rollout import RolloutProjection

    async with _log(settings) as log:
        stream = log.names.rollout(args.rollout_id)
        envelopes, _bad = decode_entries(stream, await raw_entries(log, stream))
    if not envelopes:
        print(f"error: no events for rollout {args.rollout_id}", file=sys.stderr)
        return 1
    projection = RolloutProjection()
    state = fold(projection, start(projection), envelopes).state
    for line in status_lines(state, last_stall(envelopes)):
        print(line)
    return 0


async def _pool(settings: Settings, args: argparse.Namespace) -> int:
    from engine.projections.placement import render_pool
    from engine.runtime.rebuild import pool_at

    async with _log(settings) as log:
        folded = await pool_at(log, until=args.at)
    print(render_pool(folded))
    return 0


def _events(args: argparse.Namespace) -> int:
    from engine.ops.events_doc import render_markdown, write_markdown

    if not args.markdown:
        print("error: rollout events: only --markdown is supported", file=sys.stderr)
        return 2
    if args.out is None:
        print(render_markdown(), end="")
    else:
        changed = write_markdown(args.out)
        print(f"{args.out}: {'written' if changed else 'up to date'}")
    return 0


async def _top(settings: Settings, args: argparse.Namespace) -> int:
    from engine.ops.top import run_top

    async with _log(settings) as log:
        await run_top(log, once=args.once, interval_s=args.interval, rollouts=args.rollouts)
    return 0


async def _view(settings: Settings, args: argparse.Namespace) -> int:
    from engine.ops.view import ViewData, archive_log, serve
    from engine.runtime.archive import read_archive

    def ready(url: str) -> None:
        print(f"rollout view: {url}", flush=True)

    tokenizer = None
    if settings.model_dir is not None:
        from engine.backends.sglang import load_tokenizer

        tokenizer = load_tokenizer(settings.model_dir)
    if args.source is not None:
        archived = ViewData(archive_log(read_archive(args.source)), tokenizer=tokenizer)
        await serve(archived, host=args.host, port=args.port, ready=ready)
        return 0
    async with _log(settings) as log:
        await serve(ViewData(log, tokenizer=tokenizer), host=args.host, port=args.port,
                    ready=ready)
    return 0


_COMMANDS = {
    "replay": _replay,
    "archive": _archive,
    "retention": _retention,
    "tail": _tail,
    "status": _status,
    "pool": _pool,
    "top": _top,
    "view": _view,
}


def main(
    argv: Sequence[str] | None = None,
    *,
    processes: Mapping[str, Entry] | None = None,
    rollout: Sequence[str] = (),
) -> int:
    """Run one ``rollout`` command. ``processes`` (the engine's process entry points) and
    ``rollout`` (the arguments that run this command anew) come from the top layer,
    ``workers.cli``; without them the process commands and the demo are refused."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in _DELEGATES:
        return _delegate(args_list[0], args_list[1:], processes or {}, rollout)
    try:
        settings = Settings.from_env()
    except EngineError as exc:  # a misspelt variable is refused, never silently defaulted
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser(settings)
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "env":
        print(Settings.markdown() if args.markdown else Settings.describe() + "\n", end="")
        return 0
    if args.command == "events":
        return _events(args)
    try:
        settings = _FLAGS.get(args.command, LOG_TOOL).apply(settings, args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_COMMANDS[args.command](settings, args))
    except KeyboardInterrupt:
        return 0
    except (EngineError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
