"""Runs on ranks: the world's rendezvous store, with every value the ranks write signed.

torch's TCPStore has no authentication: on a shared host (JupyterHub with local spawners, a login
node) any local user can connect to the port a world's store listens on. What the ranks read
from it decides whom they talk to: gloo's and NCCL's peers' addresses when a group forms (and
forms again at a heal), and what `all_gather_object` then unpickles arrives over those
connections. So every value set through `SignedStore` carries an HMAC of its key and value with
the world's key (known to the world's processes only; it reaches a rank over ipyparallel's signed
channel), and a value read that does not carry a valid one is refused with a clear error: a value
another process wrote never becomes an address, a flag or a pickle on a rank.

What stays possible for a process that reaches the port (docs/security.md): reading the values
(addresses and ports, nothing secret), and deleting or overwriting one, which makes the group's
forming fail with that error rather than succeed with the wrong peer. Counters (`add`) are
plain numbers the server increments: a forged count can only make a store barrier wait or fail.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from collections.abc import Sequence

import torch.distributed as dist

MAC_BYTES = 32  # HMAC-SHA256


class ForgedValueError(RuntimeError):
    """A value in the world's store that no rank of the world wrote."""


class SignedStore(dist.Store):
    """A store over `inner` (the world's TCPStore) whose values are signed with `key`.

    torch's process groups take any `dist.Store`; they see the values as the ranks wrote them.
    """

    def __init__(self, inner: dist.Store, key: bytes) -> None:
        super().__init__()
        self._inner = inner
        self._key = key

    # ------------------------------------------------------------ signed values

    def set(self, key: str, value: bytes | str) -> None:
        self._inner.set(key, self._sign(key, _bytes(value)))

    def get(self, key: str) -> bytes:
        return self._open(key, self._inner.get(key))

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set `key` to `desired` if it holds `expected` ("" for not set yet); returns what it holds."""
        expected_raw = _bytes(expected)
        if expected_raw:
            # the signed form of what a rank wrote: the same bytes, as the MAC is deterministic
            expected_raw = self._sign(key, expected_raw)
        held = self._inner.compare_set(key, expected_raw, self._sign(key, _bytes(desired)))
        return self._open(key, held) if held else held

    # ------------------------------------------------------------ passed through

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(list(keys))
        else:
            self._inner.wait(list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._inner.check(list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        return self._inner.timeout

    # ------------------------------------------------------------ the MAC

    def _sign(self, key: str, value: bytes) -> bytes:
        return self._mac(key, value) + value

    def _open(self, key: str, held: bytes) -> bytes:
        mac, value = held[:MAC_BYTES], held[MAC_BYTES:]
        if len(held) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, value)):
            raise ForgedValueError(
                f"the world's rendezvous store holds a value for {key!r} that no rank of this world wrote: "
                "another process on this host reached the store's port. The value was refused; "
                "run the cell again (the process group is set up again), and see docs/security.md"
            )
        return value

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
