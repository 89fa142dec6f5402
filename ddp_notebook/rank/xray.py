"""Runs on ranks: what collectives this rank ran and is in, answered while its main thread is blocked.

A rank blocked in a gloo collective runs nothing ipyparallel sends it, but gloo waits with the
GIL released, so a thread of ours still runs. On the notebook's host it serves a Unix socket in
the world's private directory (only the user can reach it); on another host, a TCP port on the
rank's address toward the notebook, every line signed with the world's key (`wire/xray.py`). It
answers these requests, one JSON line each, in the shapes of `wire/xray_messages.py`:

- `report`: torch's flight recorder entries of the default group (op, sequence number, shapes,
  retired or not; where this torch keeps no flight recorder for the backend, the rank's own record
  of the collectives it entered, `collective_record`), the main thread's current cell line, and
  whether it is in a cell at all;
- `release`: shut down the TCP connections the process group opened, so the collective the
  main thread waits in fails at once ("Connection closed by peer") and the process lives on.
  `ProcessGroup.abort()` returns on gloo in torch 2.13 but leaves the waiting collective
  blocked; closing the listening socket makes gloo's listener thread abort the process, so
  only connected sockets are shut down;
- `stack`: the main thread's Python frames (what `where_stuck` shows for ranks on other hosts,
  which the notebook cannot signal);
- `debug`: one line to and from the rank's waiting pdb session (`debugger`);
- `journal`: a detached world's newest cell as the rank kept it, from a given entry on (`cell_journal`).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any

from ..wire import xray as xray_wire
from ..wire import xray_messages as messages
from .state import RANK

# entries torch's flight recorder keeps per process (read when the first group is made)
FLIGHT_RECORDER_SIZE = "20"
# how many finished collectives a report carries
REPORTED_HISTORY = 5
# a collective still running after this long is read from the recorder in a light report
STABLE_SECONDS = 0.2
# the most of a rank's time the notebook's light reports may take: a reading of the recorder
# that took c seconds is reused for c / READ_SHARE (on NCCL a reading holds the GIL for
# milliseconds and, 4 times a second, cost a launch-bound GPU step 10%; gloo's takes
# microseconds, so there every report reads afresh)
READ_SHARE = 0.01
# watch connections held at once (a notebook holds one, a notebook following the world another)
MAX_WATCHERS = 4
# how the flight recorder names the default group (subgroups from new_group have names of their own)
_DEFAULT_GROUP = "default_pg"


def before_group() -> None:
    """Call right before the process group is made: turn the flight recorder on (or, where this
    torch has none, the rank's own record), note open sockets."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_SIZE)
    from . import torch_adapter

    RANK.xray.own_record = not torch_adapter.native_flight_recorder()
    if RANK.xray.own_record:
        from . import collective_record

        collective_record.start()
    RANK.xray.sockets_before = frozenset(_open_sockets().items())
    # the recorder outlives groups: entries older than this belong to a group a heal replaced
    RANK.xray.group_made_ns = time.time_ns()
    RANK.xray.default_pg_id = RANK.xray.pending = RANK.xray.light = None


def off_here() -> tuple[str, ...]:
    """What this rank's X-ray cannot see, one line each (said at %ddp_start)."""
    return (messages.OWN_RECORD_LIMIT,) if RANK.xray.own_record else ()


def serve(directory: str, rank: int) -> None:
    """Answer requests on this rank's Unix socket (once per process; heals reuse it)."""
    if RANK.xray.server is not None:
        return
    path = xray_wire.socket_path(directory, rank)
    path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o600)
    server.listen(8)
    RANK.xray.server = server
    _start_answering(server, key=None)


def serve_tcp(toward: str, key: bytes) -> tuple[str, int] | None:
    """Answer signed requests on a TCP port of this rank's address toward `toward` (the notebook's
    host), for a rank on another host; (address, port), or None where no route leads there.
    Once per process: a heal gets the same port (the world's key does not change)."""
    if RANK.xray.tcp_server is not None:
        return RANK.xray.tcp_server.getsockname()[:2]
    from ..platform.network import listen, source_address

    address = source_address(toward)
    if address is None:
        return None
    server = listen(address, backlog=8)
    RANK.xray.tcp_server = server
    _start_answering(server, key=key)
    return address, server.getsockname()[1]


def _start_answering(server: socket.socket, key: bytes | None) -> None:
    sys.breakpointhook = _stop_in_debugger  # a plain breakpoint() in a cell stops this rank in the notebook
    name = "ddp-notebook-xray" if key is None else "ddp-notebook-xray-tcp"
    threading.Thread(target=_answer_forever, args=(server, key), name=name, daemon=True).start()


def _stop_in_debugger(*_args: Any, **_kwargs: Any) -> None:
    from .debugger import stop_here

    stop_here(sys._getframe().f_back)


def _answer_forever(server: socket.socket, key: bytes | None) -> None:
    # a report's one-off imports (pdb's among them) now, not in the first cell that trains
    from ..wire import stacks  # noqa: F401
    from . import debugger, timing  # noqa: F401

    while True:
        try:
            connection, _ = server.accept()
        except OSError:
            return
        connection.settimeout(2.0)
        keep = False
        try:
            keep = _answer_one(connection, key)
        except Exception as failure:  # noqa: BLE001  (a bad request must not end the thread)
            try:
                connection.sendall(xray_wire.line(dict(messages.error_answer(repr(failure)))))
            except OSError:
                pass
        if keep:
            _hold(connection)
        else:
            connection.close()


def _hold(connection: socket.socket) -> None:
    """Keep a watch connection open until this process ends (its end closes it: the notebook's
    sign that the process is gone). A few at most: past them, the ones whose notebook closed
    its end go first, then the oldest (whose notebook confirms the close and watches again)."""
    connection.setblocking(False)  # never read, only checked: a check must not wait out its timeout
    watchers = RANK.xray.watchers
    watchers.append(connection)
    if len(watchers) > MAX_WATCHERS:
        for closed in [watcher for watcher in watchers if not _still_watched(watcher)]:
            watchers.remove(closed)
            closed.close()
    while len(watchers) > MAX_WATCHERS:
        watchers.pop(0).close()


def _still_watched(watcher: socket.socket) -> bool:
    """Whether the notebook's end of a held watch connection is open (it never writes on it)."""
    try:
        return watcher.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _answer_one(connection: socket.socket, key: bytes | None) -> bool:
    """One request, one answer; signed both ways where `key` is given (TCP), else as they come.
    True when the connection is a verified watch, to be held open."""
    reader = connection.makefile("r", encoding="utf8")
    challenge = b""
    if key is None:
        request = json.loads(reader.readline() or "{}")
    else:
        challenge = xray_wire.new_challenge()
        connection.sendall(xray_wire.line({"challenge": challenge.hex()}))
        request = xray_wire.verified(key, challenge, xray_wire.ASK, json.loads(reader.readline() or "{}"))
        if request is None:
            connection.sendall(xray_wire.line(dict(messages.error_answer(xray_wire.REFUSED))))
            return False
    watch = key is not None and request.get("ask") == "watch" and messages.version_problem(request) is None
    answer: messages.Answer = {"v": messages.XRAY_VERSION, "watching": True} if watch else answer_request(request)
    if key is not None:
        answer = xray_wire.signed(key, challenge, xray_wire.ANSWER, answer)  # type: ignore[arg-type, assignment]
    connection.sendall(xray_wire.line(answer))  # type: ignore[arg-type]
    return watch


def answer_request(request: messages.Request) -> messages.Answer:
    """The answer to one request of the notebook's (see `wire.xray_messages`)."""
    problem = messages.version_problem(request)
    if problem is not None:
        return messages.error_answer(problem)
    if request["ask"] == "report":
        return report(bool(request.get("full", True)))
    if request["ask"] == "release":
        return {"v": messages.XRAY_VERSION, "released": release_connections()}
    if request["ask"] == "debug":
        from .debugger import SESSION

        return SESSION.answer(request.get("line"))
    if request["ask"] == "stack":
        return {"v": messages.XRAY_VERSION, "frames": main_thread_frames()}
    if request["ask"] == "journal":  # a detached world's newest cell, for a kernel attached again
        from . import cell_journal

        return cell_journal.answer(dict(request))  # type: ignore[return-value]
    if request["ask"] == "owner":  # a kernel attached to a detached world: its cells only, from now on
        from . import cell_owner

        return cell_owner.answer(dict(request))  # type: ignore[return-value]
    if request["ask"] == "watch":  # only over the signed TCP line, where the connection is held
        return messages.error_answer("watch is answered on the signed TCP line of a rank on another host")
    return messages.error_answer(f"unknown request {request.get('ask')!r}")


def report(full: bool = True) -> messages.ReportAnswer:
    """The default group's recent collectives, the one(s) still running, and the main thread's cell line.

    `full=False` (what the notebook asks 4 times a second while a cell runs) reads the flight
    recorder's entries only for a collective that has been running since the last such report
    at least STABLE_SECONDS ago: a full dump costs milliseconds, its status line microseconds.
    """
    entries, last_done = _collectives(full)
    checking = _strict_check(entries, last_done)
    if checking is not None:
        entries = [*entries, checking]
    line, in_cell = _main_thread_cell_line()
    from .debugger import status
    from .timing import CLOCK

    return {
        "v": messages.XRAY_VERSION,
        "entries": entries,
        "last_done": last_done,
        "cell_line": line,
        "in_cell": in_cell,
        "now_ns": time.time_ns(),
        "steps": CLOCK.summary(),
        "memory": _memory(),
        "debugger": status(),
    }


def _collectives(full: bool) -> tuple[list[messages.CollectiveEntry], int]:
    """(entries, sequence number of the last finished collective) of the default group."""
    if full:
        return _read_collectives(True)
    now = time.monotonic()
    if RANK.xray.light is not None and now < RANK.xray.light[1]:
        return RANK.xray.light[0]  # type: ignore[no-any-return]
    began = time.perf_counter()
    found = _read_collectives(False)
    RANK.xray.light = (found, now + (time.perf_counter() - began) / READ_SHARE)
    return found


def _read_collectives(full: bool) -> tuple[list[messages.CollectiveEntry], int]:
    progress = _default_group_progress()
    if progress is None:  # unknown until this group's first collective is in the recorder
        entries = _flight_recorder_entries()
        return entries, max((e["seq"] for e in entries if e["retired"]), default=0)
    enqueued, done = progress
    if full:
        return _flight_recorder_entries(), done
    if enqueued <= done:
        RANK.xray.pending = None
        return [], done
    pending, now = RANK.xray.pending, time.monotonic()
    if pending is None or pending[0] != done + 1:
        RANK.xray.pending = (done + 1, now)  # a collective began: look closer if it is still there next time
        return [], done
    if now - pending[1] < STABLE_SECONDS:
        return [], done
    return [e for e in _flight_recorder_entries() if not e["retired"]], done


def _strict_check(entries: list[messages.CollectiveEntry], last_done: int) -> messages.CollectiveEntry | None:
    """In strict mode, the collective the rank is checking (its peers' checks not come yet), as
    the default group's next entry: the check runs on a group of its own, which the recorder
    files elsewhere, and the collective it guards is the next of the default group."""
    strict = sys.modules.get("ddp_notebook.rank.strict")
    pending = strict.checking() if strict is not None else None
    if pending is None:
        return None
    seq = max([e["seq"] for e in entries] + [last_done]) + 1
    return {
        "seq": seq,
        "op": pending["op"],
        "shapes": pending["shapes"],
        "dtypes": pending["dtypes"],
        "retired": False,
        "created_ns": pending["since_ns"],
    }


def _default_group_progress() -> tuple[int, int] | None:
    """(last enqueued, last finished) sequence numbers of the default group, from the recorder's status."""
    if RANK.xray.own_record:
        from .collective_record import progress

        return progress()
    group = RANK.xray.default_pg_id
    if group is None:
        return None
    try:
        from .torch_adapter import flight_recorder

        status = flight_recorder(entries=False)["pg_status"]
        mine = status[str(group)]
        return int(mine["last_enqueued_collective"]), int(mine["last_completed_collective"])
    except Exception:  # noqa: BLE001  (no status for it yet)
        return None


def _memory() -> dict[str, int]:
    """This process's resident bytes, and its CUDA allocator's where it uses a GPU."""
    found = {}
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            found["rss"] = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        found["cuda_allocated"] = int(torch.cuda.memory_allocated())
        found["cuda_reserved"] = int(torch.cuda.memory_reserved())
        found["cuda_peak"] = int(torch.cuda.max_memory_allocated())
    return found


def _flight_recorder_entries() -> list[messages.CollectiveEntry]:
    if RANK.xray.own_record:
        from .collective_record import entries

        return entries(REPORTED_HISTORY)
    try:
        import torch.distributed as dist

        from .torch_adapter import flight_recorder

        if not dist.is_initialized():
            return []
        dump = flight_recorder(entries=True)
    except Exception:  # noqa: BLE001  (no recorder in this build: nothing to report)
        return []
    default = [e for e in dump.get("entries", []) if _DEFAULT_GROUP in e.get("process_group", ())]
    default = [e for e in default if e.get("time_created_ns", 0) >= RANK.xray.group_made_ns]
    if default:
        RANK.xray.default_pg_id = default[-1].get("pg_id")  # its status line is then enough
    running = [e for e in default if not e.get("retired")]
    done = [e for e in default if e.get("retired")][-REPORTED_HISTORY:]
    return [_entry(e) for e in done + running]


def _entry(raw: dict[str, Any]) -> messages.CollectiveEntry:
    op = str(raw.get("profiling_name", "?")).split(":", 1)[-1]
    return {
        "seq": int(raw.get("collective_seq_id", 0)),
        "op": op,
        "shapes": [list(s) for s in raw.get("input_sizes", [])],
        "dtypes": list(raw.get("input_dtypes", [])),
        "retired": bool(raw.get("retired")),
        "created_ns": int(raw.get("time_created_ns", 0)),
    }


def main_thread_frames() -> list[tuple[str, int, str]]:
    """(file, line, function) of the main thread's Python frames, innermost first (as
    `stacks.main_thread_frames` reads them from a faulthandler dump)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    frames = []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames


def _main_thread_cell_line() -> tuple[int | None, bool]:
    from ..wire.stacks import is_cell

    return next(((line, True) for filename, line, _ in main_thread_frames() if is_cell(filename)), (None, False))


def release_connections() -> int:
    """Shut down the connected sockets opened since the group was made; returns how many.
    The notebook's watch connections are not the group's: shutting one would tell the notebook
    this process ended."""
    count = 0
    watching = {watcher.fileno() for watcher in RANK.xray.watchers}
    for fd, inode in _open_sockets().items():
        if (fd, inode) in RANK.xray.sockets_before or fd in watching:
            continue
        try:
            connection = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if connection.family not in (socket.AF_INET, socket.AF_INET6) or connection.getsockopt(
                socket.SOL_SOCKET, socket.SO_ACCEPTCONN
            ):
                continue
            connection.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            connection.close()
    return count


def _open_sockets() -> dict[int, str]:
    """{fd: 'socket:[inode]'} of this process's open sockets."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found
