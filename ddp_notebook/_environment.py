"""Names of the environment variables the notebook side sets for the processes it starts."""

OWNER_PID_ENV = "DDP_NOTEBOOK_OWNER_PID"  # the kernel's PID: its processes exit when it dies
OWNER_HOST_ENV = "DDP_NOTEBOOK_OWNER_HOST"  # the kernel's host: a PID means nothing elsewhere
SLOT_ENV = "DDP_NOTEBOOK_SLOT"  # the rank a locally launched engine was started for
PRELOAD_ENV = "DDP_NOTEBOOK_PRELOAD"  # "0" turns off importing torch while the rank registers
