"""A cell in flight, in the notebook kernel: the relay of its messages, supervision of the
ranks running it, rank-tagged output, how it ended, the X-ray reader and the debugger's
notebook side."""
