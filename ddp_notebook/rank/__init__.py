"""Everything that runs in a rank process: joining the group, the helpers of `%%ddp` cells,
checkpoints, the channel's producer side, elastic state, sharding, step timing, strict mode,
the debugger, the X-ray server, the calls the notebook makes, and the processes' entry points.

Imports torch, the standard library, `wire/` and `platform/`; never the kernel's side
(`world/`, `cell/`, `live/`), so a rank process loads none of it.
"""
