"""Addresses and routes between hosts, found without sending a packet (no torch here).

Runs on the ranks as well as in the notebook: a rank finds the address other hosts can
reach it at and the interface its traffic to rank 0 leaves by, and checks that it can
reach rank 0 before torch.distributed tries to (which would only time out, minutes later).
"""

from __future__ import annotations

import ipaddress
import socket

# a TEST-NET-1 address (RFC 5737): routed like any outside address, never answered
_OUTSIDE = "192.0.2.1"
PROBE_SECONDS = 5.0

# rank 0's listening socket for the reachability check (process state, one per process)
_probe: dict[str, socket.socket | None] = {"listener": None}


def interface_of(address: str) -> str | None:
    """Name of the network interface holding `address` (Linux), or the loopback one for 127.x."""
    if ipaddress.ip_address(address).is_loopback:
        return loopback_interface()
    try:
        import fcntl
        import struct
    except ImportError:
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def loopback_interface() -> str | None:
    """Name of the loopback network interface ('lo' on Linux, 'lo0' on macOS), if any."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        if name.startswith("lo"):
            return name
    return None


def source_address(destination: str) -> str | None:
    """The local address this host sends from to reach `destination` (None without a route).

    A UDP socket's connect only looks up the route: nothing is sent.
    """
    family = socket.AF_INET6 if ":" in destination else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((destination, 9))
        except OSError:
            return None
        return str(probe.getsockname()[0])


def interface_toward(destination: str) -> str | None:
    """Name of the interface traffic to `destination` leaves by (for GLOO/NCCL_SOCKET_IFNAME)."""
    source = source_address(destination)
    return interface_of(source) if source else None


def primary_address() -> str | None:
    """This machine's address on its default route (what other hosts usually reach it at)."""
    address = source_address(_OUTSIDE)
    if address is not None:
        return address
    try:
        candidate = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if candidate.startswith("127.") else candidate


def listen(host: str, backlog: int = 1024) -> socket.socket:
    """A TCP socket listening on `host` only, on a port the OS picks (no race for a free port)."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(backlog)
    return listener


def open_probe(host: str) -> int:
    """Listen on `host` for the other ranks' reachability check; returns the port."""
    close_probe()
    listener = _probe["listener"] = listen(host)
    return int(listener.getsockname()[1])


def close_probe() -> None:
    listener = _probe["listener"]
    if listener is not None:
        listener.close()
        _probe["listener"] = None


def reach(host: str, port: int, timeout: float = PROBE_SECONDS) -> dict[str, str | None]:
    """Try a TCP connection to rank 0's probe; say how it went and by which interface."""
    error = None
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except TimeoutError:
        error = f"no answer within {timeout:g} s"
    except OSError as failure:
        error = failure.strerror or str(failure)
    return {"host": socket.gethostname(), "error": error, "interface": interface_toward(host)}
