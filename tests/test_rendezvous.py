"""The world's rendezvous store signs what the ranks write: a value another process put there is
refused, whatever the key, and torch's process groups form over it as over a plain TCPStore."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from ddp_notebook.rank.rendezvous import MAC_BYTES, ForgedValueError, SignedStore

KEY = bytes(range(32))


@pytest.fixture
def port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def stores(port: int) -> Iterator[tuple[SignedStore, dist.TCPStore]]:
    """The world's store as a rank sees it, and a plain client of the same server (another process)."""
    timeout = datetime.timedelta(seconds=5)
    server = dist.TCPStore("127.0.0.1", port, 1, True, timeout, use_libuv=False)
    outsider = dist.TCPStore("127.0.0.1", port, 1, False, timeout, use_libuv=False)
    yield SignedStore(server, KEY), outsider


def test_values_come_back_as_written_and_carry_a_mac(stores: tuple[SignedStore, dist.TCPStore]) -> None:
    signed, outsider = stores
    signed.set("address", b"127.0.0.1:4242")
    signed.set("text", "a str is stored as its UTF-8 bytes")
    assert signed.get("address") == b"127.0.0.1:4242"
    assert signed.get("text") == b"a str is stored as its UTF-8 bytes"
    signed.multi_set(["a", "b"], [b"1", b"2"])
    assert signed.multi_get(["a", "b"]) == [b"1", b"2"]
    # what another process reads: the value, after its MAC (nothing secret is in the store)
    raw = outsider.get("address")
    assert len(raw) == MAC_BYTES + len(b"127.0.0.1:4242") and raw.endswith(b"127.0.0.1:4242")


def test_a_value_another_process_wrote_is_refused(stores: tuple[SignedStore, dist.TCPStore]) -> None:
    signed, outsider = stores
    signed.set("address", b"127.0.0.1:4242")
    outsider.set("address", b"10.9.9.9:1")  # the address of a process of its own
    with pytest.raises(ForgedValueError, match="'address' that no rank of this world wrote"):
        signed.get("address")
    # a signed value copied under another key, or with its value changed, is refused too
    signed.set("first", b"one")
    outsider.set("second", outsider.get("first"))
    with pytest.raises(ForgedValueError):
        signed.get("second")
    held = outsider.get("first")
    outsider.set("first", held[:MAC_BYTES] + b"two")
    with pytest.raises(ForgedValueError):
        signed.get("first")
    outsider.set("short", b"x")
    with pytest.raises(ForgedValueError):
        signed.get("short")
    # signed with another world's key
    SignedStore(outsider, bytes(32)).set("other", b"value")
    with pytest.raises(ForgedValueError):
        signed.get("other")


def test_compare_set_counters_and_the_rest_pass_through(stores: tuple[SignedStore, dist.TCPStore]) -> None:
    signed, outsider = stores
    assert signed.compare_set("flag", "", b"first") == b"first"  # not set yet: set
    assert signed.compare_set("flag", b"other", b"second") == b"first"  # held something else: kept
    assert signed.compare_set("flag", b"first", b"second") == b"second"
    assert signed.get("flag") == b"second"
    assert signed.add("count", 2) == 2 and signed.add("count", 3) == 5 and outsider.add("count", 0) == 5
    assert signed.check(["flag", "count"]) and not signed.check(["absent"])
    signed.wait(["flag"], datetime.timedelta(seconds=1))
    with pytest.raises(dist.DistStoreError):
        signed.wait(["absent"], datetime.timedelta(milliseconds=100))
    keys = signed.num_keys()
    assert signed.delete_key("flag") and signed.num_keys() == keys - 1
    signed.set_timeout(datetime.timedelta(seconds=3))
    assert signed.timeout == datetime.timedelta(seconds=3)


def test_a_process_group_forms_over_it_and_reads_its_values_through_it(port: int) -> None:
    timeout = datetime.timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", port, 1, True, timeout, use_libuv=False)
    signed = SignedStore(server, KEY)
    dist.init_process_group("gloo", store=signed, rank=0, world_size=1, timeout=timeout)
    try:
        total = torch.ones(3)
        dist.all_reduce(total)
        gathered: list[object] = [None]
        dist.all_gather_object(gathered, {"rank": 0})
        assert total.tolist() == [1.0, 1.0, 1.0] and gathered == [{"rank": 0}]
        # the group's own store (torch's prefix over ours) writes and reads through the signature
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        assert store is signed
    finally:
        dist.destroy_process_group()
