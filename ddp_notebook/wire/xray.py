"""The X-ray's wire: one JSON request line, one JSON answer line, on a connection of its own.

A rank on the notebook's host answers on a Unix socket in the world's private directory: the
file's mode (0600) is the authentication, and nothing crosses a network. A rank on another
host answers over TCP, on its address toward the notebook, and there anyone on the network
could connect, so both lines are signed with the world's key (HMAC-SHA256, 32 random bytes,
made by the notebook and given to the rank through ipyparallel's encrypted channel):

1. the rank sends a fresh random challenge: `{"challenge": HEX}`;
2. the notebook sends its request signed over the challenge: `{..., "mac": HEX}`; a request
   with no valid signature is refused and not acted on (a recorded request cannot be replayed:
   the next connection has another challenge);
3. the rank sends its answer signed over the same challenge, which the notebook checks.

The lines are signed, not encrypted: they carry collective names, shapes, cell line numbers
and pdb's output, no more than the tensors gloo itself sends in the clear between the hosts.
Pure logic, standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from pathlib import Path
from typing import Any

KEY_BYTES = 32
CHALLENGE_BYTES = 16
# what each signature covers besides the payload, so an answer can never pass as a request
ASK, ANSWER = b"ask", b"answer"
_KEY_FILE = "xray.key"


def socket_path(directory: str, rank: int) -> Path:
    """Where a rank on the notebook's host answers: a Unix socket in the world's private directory."""
    return Path(directory) / f"rank{rank}.xray"


REFUSED = "not authenticated: the request is not signed with the world's key"


# read once per world: the notebook asks for the key with every reading, 4 times a second
_keys: dict[str, bytes] = {}


def world_key(directory: str) -> bytes:
    """The world's key, kept in its private directory (made there, mode 0600, on first use)."""
    if directory in _keys:
        return _keys[directory]
    path = Path(directory) / _KEY_FILE
    try:
        key = bytes.fromhex(path.read_text(encoding="ascii"))
    except (OSError, ValueError):
        key = secrets.token_bytes(KEY_BYTES)
        path.touch(mode=0o600)
        path.write_text(key.hex(), encoding="ascii")
    _keys[directory] = key
    return key


def rendezvous_key(directory: str) -> bytes:
    """The key the ranks sign the rendezvous store's values with: the world's key, put to one use
    of its own (a value signed for the store is no X-ray answer, and the other way round)."""
    return hmac.new(world_key(directory), b"ddp_notebook rendezvous store", hashlib.sha256).digest()


def new_challenge() -> bytes:
    return secrets.token_bytes(CHALLENGE_BYTES)


def _canonical(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def signature(key: bytes, challenge: bytes, purpose: bytes, payload: dict[str, Any]) -> str:
    return hmac.new(key, challenge + purpose + _canonical(payload), hashlib.sha256).hexdigest()


def signed(key: bytes, challenge: bytes, purpose: bytes, payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` with its signature added under "mac"."""
    return {**payload, "mac": signature(key, challenge, purpose, payload)}


def verified(key: bytes, challenge: bytes, purpose: bytes, message: Any) -> dict[str, Any] | None:
    """`message` without its signature if the signature is right, else None."""
    if not isinstance(message, dict) or not isinstance(message.get("mac"), str):
        return None
    payload = {k: v for k, v in message.items() if k != "mac"}
    expected = signature(key, challenge, purpose, payload)
    return payload if hmac.compare_digest(expected, message["mac"]) else None


def line(payload: dict[str, Any]) -> bytes:
    return (json.dumps(payload) + "\n").encode()
