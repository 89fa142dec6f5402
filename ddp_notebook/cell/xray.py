"""Collective X-ray, notebook side: what each rank ran and waits in, and mismatches named in seconds.

Each rank answers from a thread of its own (`xray_rank`), so it answers while it is blocked in
a collective: a rank on this host on a Unix socket in the world's private directory, a rank on
another host over TCP, each line signed with the world's key (`xray_wire`). From the answers:
per rank the last collectives (op, sequence number, shapes) from torch's flight recorder, the
one it waits in, for how long, and its cell line (`live.xray_readings`: the readings as data,
which the live view draws too).

`MismatchWatch` turns repeated readings into a verdict: ranks blocked in collectives that
cannot match (different sequence numbers, ops or shapes), or ranks blocked in a collective
that a rank which already finished the cell never ran. A verdict needs the same picture in
two readings at least `CONFIRM_SECONDS` apart, so a healthy world, where the picture changes
every step, never gives one. Imports nothing of torch.
"""

from __future__ import annotations

import errno
import json
import selectors
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..errors import GROUP_ABOVE, RankError, RankFailure, group_ranks, name_ranks
from ..live.grouping import grouped_waits, seconds_range
from ..live.stragglers import find_straggler
from ..live.xray_readings import RankCollectives, parse_report
from ..wire import xray as xray_wire
from ..wire import xray_messages as messages
from ..wire.results import RankInfo

# how long one rank may take to answer (it answers from a thread of its own, in microseconds)
ANSWER_SECONDS = 1.0
# a mismatch is confirmed by a second reading this much later showing the same picture
CONFIRM_SECONDS = 1.0
# ranks on other hosts asked side by side in one reading
REMOTE_ASKS_AT_ONCE = 16
# a rank whose watch connection could not be opened is tried again this much later
WATCH_RETRY_SECONDS = 5.0
# opening one: short, since a death check waits for it (a rank that answers does in milliseconds)
WATCH_CONNECT_SECONDS = 0.5
# keepalive on a watch connection: probes after 2 s of quiet, one a second, 3 unanswered = silent
# (about 5 s; the controller's heartbeat takes 10 s to drop a rank)
KEEPALIVE_IDLE_SECONDS, KEEPALIVE_INTERVAL_SECONDS, KEEPALIVE_PROBES = 2, 1, 3
WATCH_SILENT_SECONDS = KEEPALIVE_IDLE_SECONDS + KEEPALIVE_INTERVAL_SECONDS * KEEPALIVE_PROBES


@dataclass(frozen=True)
class Reach:
    """How the notebook reaches each rank's X-ray: a rank here by its Unix socket in `directory`,
    a rank on another host at its TCP address in `remote`, signed with the world's `key`."""

    directory: str
    remote: Mapping[int, tuple[str, int]] = field(default_factory=dict)
    key: bytes = b""

    @classmethod
    def of(cls, directory: str, infos: Iterable[RankInfo]) -> Reach:
        here = socket.gethostname()
        remote = {i.rank: i.xray_address for i in infos if i.host != here and i.xray_address is not None}
        return cls(directory, remote, xray_wire.world_key(directory) if remote else b"")


def ask(reach: Reach, rank: int, request: messages.Request, timeout: float = ANSWER_SECONDS) -> Any:
    """One request to one rank: its answer (the `messages` type the request asks for), or None when
    it does not answer in time, answers with an error, or its answer is not signed right or is
    of another version of the format."""
    address = reach.remote.get(rank)
    try:
        if address is None:
            answer = _ask_here(xray_wire.socket_path(reach.directory, rank), dict(request), timeout)
        else:
            answer = _ask_elsewhere(address, reach.key, dict(request), timeout)
    except (OSError, ValueError):
        return None
    if not isinstance(answer, dict) or "error" in answer or messages.version_problem(answer) is not None:
        return None
    return answer


def _ask_here(path: Any, request: dict[str, Any], timeout: float) -> Any:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(timeout)
        connection.connect(str(path))
        connection.sendall(xray_wire.line(request))
        return json.loads(connection.makefile("r", encoding="utf8").readline())


def _ask_elsewhere(address: tuple[str, int], key: bytes, request: dict[str, Any], timeout: float) -> Any:
    with socket.create_connection(address, timeout=min(timeout, ANSWER_SECONDS)) as connection:
        connection.settimeout(timeout)
        reader = connection.makefile("r", encoding="utf8")
        challenge = bytes.fromhex(json.loads(reader.readline())["challenge"])
        connection.sendall(xray_wire.line(xray_wire.signed(key, challenge, xray_wire.ASK, request)))
        return xray_wire.verified(key, challenge, xray_wire.ANSWER, json.loads(reader.readline()))


class ProcessWatch:
    """One held `watch` connection per rank on another host: when the rank's process ends, its
    host closes the connection, and `ended` names the rank at the next death check, where the
    controller's heartbeat takes about 10 s. A host that goes silent (power, network) closes
    nothing: the connection's keepalive probes go unanswered and `ended` names it SILENT.

    A closed connection is confirmed by a new one before it is a verdict: a rank also lets go of
    a watcher when more notebooks watch it than it holds (`rank.xray.MAX_WATCHERS`), and a close
    read late (the first death check after a quiet spell) may be older than what the host does
    now. Thread-safe: the relay's death checks and the world's regroup both call it."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], socket.socket] = {}  # (host, pid) -> its connection
        self._selector = selectors.DefaultSelector()
        self._tried: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()

    def watch(self, reach: Reach, infos: Iterable[RankInfo]) -> None:
        """Open the connections of the ranks among `infos` on other hosts not watched yet."""
        with self._lock:
            remote = [i for i in infos if i.rank in reach.remote and (i.host, i.pid) not in self._held]
            self._open(reach, remote)

    def ended(self, reach: Reach, infos: Iterable[RankInfo]) -> dict[int, str]:
        """The ranks among `infos` on other hosts that are gone, each with how it was seen: ENDED
        (its host closed the connection and refused a new one: the process is gone, the host
        answers) or SILENT (its host stopped answering: the keepalive probes of the connection,
        or the new connection that confirms a close)."""
        with self._lock:
            remote = {(i.host, i.pid): i for i in infos if i.rank in reach.remote}
            opened = self._open(reach, [i for key, i in remote.items() if key not in self._held])
            gone = {info.rank: ENDED for info, outcome in opened if outcome is REFUSED}
            closed: list[RankInfo] = []
            for selected, _ in self._selector.select(timeout=0) if self._held else []:
                key, connection = selected.data, selected.fileobj
                verdict = _verdict(connection)  # type: ignore[arg-type]
                if verdict is None:
                    continue
                self._drop(key, connection)  # type: ignore[arg-type]
                if key not in remote:
                    continue
                if verdict == ENDED:
                    closed.append(remote[key])
                else:
                    gone[remote[key].rank] = verdict
            for info, outcome in self._open(reach, closed, confirming=True):
                if outcome is REFUSED:
                    gone[info.rank] = ENDED
                elif outcome is NO_ANSWER:
                    gone[info.rank] = SILENT
                # watched again: the process lives; None: its host answers and its X-ray does not
                # (a stopped process): the heartbeat names it
            return gone

    def _open(self, reach: Reach, infos: list[RankInfo], confirming: bool = False) -> list[tuple[RankInfo, Any]]:
        """Open watch connections to `infos` (those not tried lately, unless `confirming` a close),
        side by side; returns each one tried with what `_watch` gave, the opened ones now held."""
        now = time.monotonic()
        due = [
            i
            for i in infos
            if confirming or now - self._tried.get((i.host, i.pid), -WATCH_RETRY_SECONDS) >= WATCH_RETRY_SECONDS
        ]
        if not due:
            return []
        for info in due:
            self._tried[(info.host, info.pid)] = now
        with ThreadPoolExecutor(max_workers=min(REMOTE_ASKS_AT_ONCE, len(due))) as pool:
            opened = list(pool.map(lambda i: _watch(reach.remote[i.rank], reach.key), due))
        for info, connection in zip(due, opened):
            if isinstance(connection, socket.socket):
                key = (info.host, info.pid)
                self._held[key] = connection
                self._selector.register(connection, selectors.EVENT_READ, key)
        return list(zip(due, opened))

    def _drop(self, key: tuple[str, int], connection: socket.socket | None = None) -> None:
        """Let go of `connection` (by default the one held for `key`)."""
        connection = connection or self._held.get(key)
        if connection is None:
            return
        if self._held.get(key) is connection:
            del self._held[key]
        self._selector.unregister(connection)
        connection.close()

    def close(self) -> None:
        with self._lock:
            for key in list(self._held):
                self._drop(key)
            self._selector.close()


REFUSED = "refused"  # _watch: the host answered and nothing listens on the rank's port
NO_ANSWER = "no answer"  # _watch: the host did not answer the connection (silent, or unreachable)
ENDED, SILENT = "ended", "silent"  # how ProcessWatch saw a rank go
# errors of a connection whose peer host stopped answering (keepalive probes unanswered, no route)
_SILENT_ERRORS = {errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}


def _verdict(connection: socket.socket) -> str | None:
    """What a watch connection that became readable says: ENDED, SILENT, or None (still open)."""
    error = connection.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if error:
        return SILENT if error in _SILENT_ERRORS else ENDED
    try:
        data = connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except OSError as failure:
        return SILENT if failure.errno in _SILENT_ERRORS else ENDED
    return ENDED if data == b"" else None  # the rank never writes on it: data is no verdict


def _watch(address: tuple[str, int], key: bytes) -> socket.socket | str | None:
    """A connection the rank at `address` holds open for its process's life; REFUSED when its
    host refuses the connection (the process that listened there is gone), NO_ANSWER when the
    host does not answer it in WATCH_CONNECT_SECONDS; None otherwise (the rank's X-ray did not
    answer: a stopped or starved process, another key)."""
    try:
        connection = socket.create_connection(address, timeout=WATCH_CONNECT_SECONDS)
    except ConnectionRefusedError:
        return REFUSED
    except TimeoutError:
        return NO_ANSWER
    except OSError as failure:
        return NO_ANSWER if failure.errno in _SILENT_ERRORS else None
    # the host's kernel answers keepalive probes whatever its process does (busy, stopped): a
    # host that goes silent fails them within about WATCH_SILENT_SECONDS, before the heartbeat
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's keepalive timing holds
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_SECONDS)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_SECONDS)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    try:
        reader = connection.makefile("r", encoding="utf8")
        challenge = bytes.fromhex(json.loads(reader.readline())["challenge"])
        request = dict(messages.watch_request())
        connection.sendall(xray_wire.line(xray_wire.signed(key, challenge, xray_wire.ASK, request)))
        answer = xray_wire.verified(key, challenge, xray_wire.ANSWER, json.loads(reader.readline()))
        reader.close()
        if isinstance(answer, dict) and answer.get("watching") is True:
            connection.setblocking(False)  # held, never read: `_verdict` peeks without waiting
            return connection
    except (OSError, ValueError, KeyError):
        pass
    connection.close()
    return None


def read_ranks(reach: Reach, ranks: Iterable[int], full: bool = True) -> dict[int, RankCollectives]:
    """The X-ray of `ranks` (those that answered). `full=False`: a light reading, with a running
    collective only once it has run a moment (what a running cell's watch asks)."""
    ranks = list(ranks)
    elsewhere = [rank for rank in ranks if rank in reach.remote]
    if len(elsewhere) > 1:
        # each answer from another host takes a network round trip, a lost host a connect timeout:
        # ask them side by side, so a reading takes one of those, not one per rank
        with ThreadPoolExecutor(max_workers=min(len(elsewhere), REMOTE_ASKS_AT_ONCE)) as pool:
            answers = dict(zip(elsewhere, pool.map(lambda r: ask(reach, r, messages.report_request(full)), elsewhere)))
    else:
        answers = {}
    found = {}
    for rank in ranks:
        answer = answers[rank] if rank in answers else ask(reach, rank, messages.report_request(full))
        if answer is not None:
            found[rank] = parse_report(rank, answer)
    return found


def main_thread_frames(reach: Reach, rank: int) -> list[tuple[str, int, str]]:
    """(file, line, function) of `rank`'s main thread, innermost first, as its X-ray thread reads them."""
    answer: messages.StackAnswer | None = ask(reach, rank, messages.stack_request())
    if answer is None:
        return []
    return [(str(f), int(n), str(name)) for f, n, name in answer.get("frames", ())]


def release(reach: Reach, ranks: Iterable[int]) -> dict[int, int]:
    """Make `ranks` shut their process group's connections; {rank: connections shut} of those that answered."""
    done = {}
    for rank in ranks:
        answer: messages.ReleaseAnswer | None = ask(reach, rank, messages.release_request())
        if answer is not None:
            done[rank] = int(answer.get("released", 0))
    return done


def describe_world(readings: Mapping[int, RankCollectives]) -> str:
    """Per rank: its collectives, its recent steps and its allocator's memory; then the straggler, if any."""
    lines = []
    if len(readings) > GROUP_ABOVE:  # the ranks grouped by where they are; the seconds each waited aside
        return "\n".join(_grouped_world(readings))
    for rank in sorted(readings):
        reading = readings[rank]
        lines.append(f"rank {rank}: {reading.describe()}")
        if reading.steps is not None:
            lines.append(f"  steps: {reading.steps.describe()}")
        cuda = {k: v for k, v in reading.memory.items() if k.startswith("cuda_")}
        if cuda:
            lines.append("  cuda: " + ", ".join(f"{k[5:]} {v / 2**20:.0f} MiB" for k, v in cuda.items()))
    straggler = find_straggler({rank: r.steps for rank, r in readings.items() if r.steps is not None})
    if straggler is not None:
        lines.append(straggler.describe())
    return "\n".join(lines)


def _grouped_world(readings: Mapping[int, RankCollectives]) -> list[str]:
    """A large world's X-ray: one line per place (collective, sequence number, cell line) with its
    ranks, each place's wait as a range; then the straggler, if any."""
    places = [
        (rank, reading.describe(waited=False), reading.waited if reading.current is not None else None)
        for rank, reading in readings.items()
    ]
    lines = grouped_waits(places, waited=" (waiting {})")
    straggler = find_straggler({rank: r.steps for rank, r in readings.items() if r.steps is not None})
    if straggler is not None:
        lines.append(straggler.describe())
    return lines


@dataclass(frozen=True)
class Mismatch:
    """Ranks that can never meet in their collectives, named with their collectives and cell lines."""

    summary: str
    blocked: tuple[int, ...]
    details: tuple[str, ...]
    waited: float = 0.0  # seconds the blocked ranks had waited when it was found

    def describe(self) -> str:
        found = f" (found {self.waited:.1f} s after the first of these collectives began)" if self.waited else ""
        return "\n".join((self.summary + found, *(f"  {line}" for line in self.details)))


def find_mismatch(readings: Mapping[int, RankCollectives], finished: Iterable[int]) -> Mismatch | None:
    """A mismatch in one reading: pure logic over what the ranks said (see MismatchWatch)."""
    finished = set(finished)
    running = {rank: r for rank, r in readings.items() if rank not in finished}
    blocked = {rank: r for rank, r in running.items() if r.current is not None}
    if not blocked:
        return None

    gone = [readings[rank] for rank in sorted(finished) if rank in readings]
    skipped = [f for f in gone if any(f.last_seq < b.current.seq for b in blocked.values() if b.current is not None)]
    if skipped:
        details = _waiting(blocked.values()) + _finished_after(skipped, blocked.values())
        wait = "wait" if len(blocked) > 1 else "waits"
        return Mismatch(
            f"collective mismatch: {name_ranks(r.rank for r in skipped)} finished the cell without a collective "
            f"that {name_ranks(blocked)} {wait} in",
            tuple(sorted(blocked)),
            tuple(details),
            max(r.waited for r in blocked.values()),
        )
    if len(blocked) < len(running) or len(blocked) < 2:
        return None  # some rank is still computing: it may yet reach the collective
    signatures = {r.current.signature() for r in blocked.values() if r.current is not None}
    if len(signatures) == 1:
        return None
    seqs = {s[0] for s in signatures}
    ops = {s[1] for s in signatures}
    what = "sequence numbers" if len(seqs) > 1 else "ops" if len(ops) > 1 else "shapes"
    return Mismatch(
        f"collective mismatch: every rank is blocked, in collectives with different {what}",
        tuple(sorted(blocked)),
        tuple(_waiting(blocked.values())),
        max(r.waited for r in blocked.values()),
    )


class MismatchWatch:
    """Readings over time to a confirmed mismatch: the same one seen twice, CONFIRM_SECONDS apart."""

    def __init__(self, confirm_seconds: float = CONFIRM_SECONDS) -> None:
        self.confirm_seconds = confirm_seconds
        self._seen: tuple[Any, ...] | None = None
        self._seen_at = 0.0

    def check(
        self, readings: Mapping[int, RankCollectives], finished: Iterable[int], now: float | None = None
    ) -> Mismatch | None:
        now = time.monotonic() if now is None else now
        finished = tuple(sorted(finished))
        found = find_mismatch(readings, finished)
        if found is None:
            self._seen = None
            return None
        picture = (finished, tuple((rank, r.current and r.current.signature()) for rank, r in sorted(readings.items())))
        if picture != self._seen:
            self._seen, self._seen_at = picture, now
            return None
        return found if now - self._seen_at >= self.confirm_seconds else None


class CollectiveMismatchError(RankError):
    """Ranks were blocked in collectives that could never match: they were released from them
    (the failures are what they raised then), their state kept."""

    def __init__(self, mismatch: Mismatch, failures: Iterable[RankFailure], note: str = "") -> None:
        super().__init__(list(failures), note=note.strip())
        self.mismatch = mismatch
        self.args = (mismatch.summary,)

    def __str__(self) -> str:
        return self.mismatch.summary

    def _render_traceback_(self) -> list[str]:
        lines = [self.mismatch.describe()]
        lines.append("the blocked ranks were released from their collectives (their processes and variables are kept)")
        if self.note:
            lines.append(self.note.strip())
        return lines


def _waiting(blocked: Iterable[RankCollectives]) -> list[str]:
    """The blocked ranks, those in the same collective at the same cell line on one line, with the
    seconds they waited: "ranks 0-2 wait in all_reduce #4 [4], cell line 5 (3.1-3.4 s)"."""
    readings = {r.rank: r for r in blocked}
    lines = []
    for place, ranks in group_ranks((rank, _place(r)) for rank, r in readings.items()).items():
        seconds = seconds_range([readings[rank].waited for rank in ranks])
        lines.append(f"{name_ranks(ranks)} {'wait' if len(ranks) > 1 else 'waits'} in {place} ({seconds})")
    return lines


def _place(reading: RankCollectives) -> str:
    current = reading.current
    assert current is not None
    return current.describe() + (f", cell line {reading.cell_line}" if reading.cell_line is not None else "")


def _finished_after(finished: Iterable[RankCollectives], blocked: Iterable[RankCollectives]) -> list[str]:
    """The ranks that finished the cell without the collective others wait in, those that stopped at
    the same one on one line."""
    blocked = list(blocked)

    def said(f: RankCollectives) -> str:
        missed = ", ".join(f"#{b.current.seq}" for b in blocked if b.current and b.current.seq > f.last_seq)
        after = f"after collective #{f.last_seq}" if f.last_seq else "without any collective"
        return f"finished the cell {after}: {{they}} never ran {missed}"

    groups = group_ranks((f.rank, said(f)) for f in finished)
    return [
        f"{name_ranks(ranks)} " + what.format(they="they" if len(ranks) > 1 else "it") for what, ranks in groups.items()
    ]
