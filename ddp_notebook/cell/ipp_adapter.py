"""Every use of ipyparallel's private internals, in one place.

ipyparallel offers no public way to do these few things, so they reach into its objects.
Each function is exercised by `tests/test_ipp_adapter.py`, which `benchmarks/compat.py` runs on
every ipyparallel of the range `pyproject.toml` declares (8.8 to 9.x): a new ipyparallel that
moves one of these fails there first.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("ddp_notebook")


def message_futures(async_result: Any) -> Sequence[Any]:
    """The per-engine message futures of an AsyncResult, in the order of its targets.

    Each one carries the engine's output metadata and the IOPub callbacks we register on.
    """
    return async_result._children  # type: ignore[no-any-return]


def execute_watched(view: Any, code: str, watch: Callable[[int, Any], None]) -> Any:
    """`view.execute(code, silent=False, block=False)`, each engine's message future handed to
    `watch(index, future)` (its index among the view's targets) before its request is sent, and
    each request marked `stop_on_error: false`.

    ipyparallel hands each request to its IO thread to send; the futures exist before that, and
    `Client._send`'s `message_future_hook` gives each one to the caller then. A callback
    registered there sees every message of the reply, without a trip through the IO thread of its
    own (one wake-up of that thread less per cell).

    `stop_on_error`: an engine kernel whose cell raised aborts, by default, the execute requests
    that reach it before it is done with the error; on ipykernel 6 that window outlives the
    reply, so the next cell, sent as soon as the last rank replied, could be skipped on one rank
    while the others ran it (and waited in its collectives). The notebook's own kernel already
    stops a notebook at an error; the ranks never need to. `send_execute_request` sets no
    `stop_on_error`, so the request is built here as it builds it, plus that field.
    """
    from ipyparallel.client.asyncresult import AsyncResult

    client = view.client
    idents, targets = client._build_targets(view.targets)
    label = getattr(view, "label", None)  # ipyparallel 9's views label their requests; 8.8's do not
    content = {"code": code, "silent": False, "user_expressions": {}, "stop_on_error": False}
    futures = [
        client._send(
            view._socket,
            "execute_request",
            content=content,
            ident=ident,
            metadata={"label": label} if label is not None else {},
            track_outstanding=True,
            message_future_hook=lambda future, index=index: watch(index, future),
        )
        for index, ident in enumerate(idents)
    ]
    return AsyncResult(client, futures, fname="execute", targets=targets, owner=True)


def on_io_thread(client: Any, callback: Callable[[], None]) -> None:
    """Run `callback` on the client's IO thread, after what was handed to it before.

    Registering a message callback there means each message is seen exactly once.
    """
    client._io_loop.add_callback(callback)


def send_queue_request(client: Any) -> Any:
    """Ask the controller for its queue status without waiting; returns a future of the reply.

    `Client.queue_status` sends the same request but waits for the answer without a limit.
    """
    return client._send(client._query_stream, "queue_request", content={"targets": None, "verbose": False})


def learn_registered_engines(client: Any) -> Any:
    """Ask the controller which engines registered and add those the client has not heard of;
    returns the future of the answer (the engines are added on the client's IO thread).

    A client hears of engines from the controller's answer to its connection request and from
    then on by notifications on a subscription it opens after that answer; an engine whose
    registration finished in between is never heard of (a world's ranks register while its client
    connects). Nothing public asks again.
    """
    future = client._send(client._query_stream, "connection_request")

    def learn(answered: Any) -> None:
        try:
            engines = dict(answered.result()["content"]["engines"])
        except Exception:  # noqa: BLE001  (no answer: the next ask may have one)
            return
        client._io_loop.add_callback(lambda: client._update_engines(engines))

    future.add_done_callback(learn)
    return future


def unwrap_exception(client: Any, content: dict[str, Any]) -> Any:
    """An engine's error reply as the RemoteError ipyparallel would raise for it."""
    return client._unwrap_exception(content)


def recorded_exit(engine_set: Any) -> int | None:
    """The exit code an engine-set launcher recorded for a stopped engine, if it did."""
    stop_data = getattr(engine_set, "stop_data", None) or {}
    for engine in (stop_data.get("engines") or {}).values():
        if isinstance(engine, dict) and engine.get("exit_code") is not None:
            return int(engine["exit_code"])
    return None


def parse_reply_dates_quickly() -> None:
    """Make the client read the time a rank started a request with `datetime.fromisoformat`.

    ipyparallel parses it with dateutil's general parser for every reply: a tenth of the kernel's
    CPU per rank per cell in a large world. The timestamps are ISO 8601 that `fromisoformat`
    reads (Python 3.11); anything it does not read goes to ipyparallel's own parser, as before.
    """
    from ipyparallel import util

    original = util._parse_date
    if getattr(original, "quick", False):
        return

    def parse_date(text: Any) -> Any:
        if isinstance(text, str) and util.ISO8601_PAT.match(text):
            try:
                moment = datetime.datetime.fromisoformat(text)
            except ValueError:
                return original(text)
            if moment.tzinfo is not None:
                return moment
        return original(text)

    parse_date.quick = True  # type: ignore[attr-defined]
    util._parse_date = parse_date


class WatchedExit:
    """Mixin for ipyparallel's SSH engine launcher: its engine's exit is noticed by a watch of its
    host that the subclass keeps (`watch_exit`), in place of the thread ipyparallel starts per engine
    (`_start_waiting`), which holds an ssh session open to the host for the engine's whole life."""

    def _start_waiting(self) -> None:
        self.loop  # type: ignore[attr-defined]  # noqa: B018  (bound on the starting thread, as ipyparallel's is)
        self._stop_waiting = threading.Event()
        self._wait_thread = None  # join() then leaves the event to end_watch
        self.watch_exit()

    def watch_exit(self) -> None:
        raise NotImplementedError

    def started(self, pid: int) -> None:
        """The engine runs as `pid` on its host, started by the subclass: what ipyparallel's start
        does after its own (the start notice, the watch of its exit)."""
        self.pid = pid
        self.notify_start({"host": self.location, "pid": pid})  # type: ignore[attr-defined]
        self._start_waiting()

    @property
    def watched(self) -> bool:
        """Whether the engine's exit is still to be noticed: it runs, and its launcher did not stop it."""
        stopping = getattr(self, "_stop_waiting", None)
        return bool(self.state == "running" and stopping is not None and not stopping.is_set())  # type: ignore[attr-defined]

    def end_watch(self) -> None:
        stopping = getattr(self, "_stop_waiting", None)
        if stopping is not None:
            stopping.set()

    def exited(self, exit_code: int) -> None:
        """Tell ipyparallel the engine ended, on the launcher's loop, as its waiting thread did."""
        data = {"exit_code": exit_code, "pid": self.pid, "identifier": self.identifier}  # type: ignore[attr-defined]
        try:
            self.loop.add_callback(lambda: self.notify_stop(data))  # type: ignore[attr-defined]
        except RuntimeError:  # the loop has closed: the cluster stopped, nobody waits for it
            pass


# the Client's handlers of what its streams receive, each unpacking a message before it reads it
_dropped = [0]  # messages dropped so far in this process
_CLIENT_DISPATCHERS = ("_dispatch_single_reply", "_dispatch_notification", "_dispatch_reply", "_dispatch_iopub")


def drop_malformed_messages() -> list[str]:
    """Make the client drop a message that has no delimiter frame, as it drops an unsigned one.

    ipyparallel's `unpack_message` looks for the delimiter before its own `try`: such a message
    raises out of the stream's callback, and the stream, its socket's events edge-triggered, reads
    nothing more (the cell's output stops there, its replies never come). A controller's ports are
    open to every local user, and libzmq speaks ZMTP 1.0 to a peer that greets it so, with no socket
    type check: a few bytes to a port put frames of one's choosing into its queues, which forward
    them to the client. Returns the handlers it guards (none where this ipyparallel has none of them).
    """
    from ipyparallel.client.client import Client

    guarded = []
    for name in _CLIENT_DISPATCHERS:
        dispatch = getattr(Client, name, None)
        if dispatch is None:
            continue
        if not getattr(dispatch, "drops_malformed", False):
            setattr(Client, name, _dropping_malformed(dispatch))
        guarded.append(name)
    return guarded


def _dropping_malformed(dispatch: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def guarded(client: Any, msg_parts: Any) -> Any:
        try:
            client.session.feed_identities(msg_parts, copy=False)
        except ValueError:
            _dropped[0] += 1
            if _dropped[0] == 1:  # once: whoever sends them can send many
                log.warning("dropped a message with no delimiter on the world's client (more are dropped silently)")
            return None
        return dispatch(client, msg_parts)

    guarded.drops_malformed = True  # type: ignore[attr-defined]
    guarded.__name__ = getattr(dispatch, "__name__", "dispatch")
    return guarded
