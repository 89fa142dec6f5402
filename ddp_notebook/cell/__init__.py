"""A cell in flight, in the notebook kernel: the relay of its messages (what it asks of the world
while it waits, a protocol the world answers), rank-tagged output, how it ended, the X-ray reader,
the debugger's notebook side, ipyparallel's adapter. Imports `live/`, never `world/`."""
