"""The sbatch script of a batch job: an exported torchrun script run on every node of a Slurm
allocation (`%ddp_export train.py --submit slurm`).

Kernel side, no torch. One `srun` task per node starts torchrun there, which starts the node's
ranks; the rendezvous (torchrun's c10d) is on the allocation's first node, at the address Slurm
itself reaches that node by (`NodeAddr`), so no node has to resolve another's hostname. The job
gets the settings the notebook's ranks had: threads, the world's environment, the backend, and
the interface toward the rendezvous for gloo and NCCL (as `rank_environment` pins it).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import DDPUsageError

# torchrun's rendezvous port: fixed per job (every node must know it before any starts), below
# Linux's ephemeral range (32768+) so a client socket of the node rarely holds it
RDZV_BASE_PORT = 29500
RDZV_PORT_SPREAD = 2000
# the last line the batch script writes: how the job ended, readable after Slurm forgot the job
END_MARKER = "[ddp_notebook] job {job} ended: exit code {code}"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class JobSpec:
    """What one batch job runs, and where: checked when made, rendered by `render`."""

    script: str  # the exported torchrun script, absolute
    log: str  # the job's log, absolute; %j is the job id
    workdir: str  # where the ranks run (the notebook's folder: the cells' relative paths hold)
    python: str  # the interpreter of every node (the world's own: the same path on every host)
    nodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int | None = None  # with GPUs: nccl, one rank per GPU
    threads: int = 1  # OMP_NUM_THREADS of each rank, as in the notebook's world
    env: Mapping[str, str] = field(default_factory=dict)
    time_limit: str | None = None
    partition: str | None = None
    account: str | None = None
    name: str = "train"

    def __post_init__(self) -> None:
        for label, value in (("--nodes", self.nodes), ("ranks per node", self.nproc_per_node)):
            if value < 1:
                raise DDPUsageError(f"{label} must be >= 1, got {value}")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise DDPUsageError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if self.threads < 1:
            raise DDPUsageError(f"threads per rank must be >= 1, got {self.threads}")
        bad = [name for name in self.env if not _ENV_NAME.match(name)]
        if bad:
            raise DDPUsageError(f"cannot pass environment variable(s) {', '.join(map(repr, bad))} to a batch job")
        for label, value in (("--time", self.time_limit), ("--partition", self.partition), ("--account", self.account)):
            if value is not None and (not value.strip() or any(c.isspace() for c in value)):
                raise DDPUsageError(f"{label} takes one word, got {value!r}")

    @property
    def backend(self) -> str:
        return "nccl" if self.gpus_per_node else "gloo"

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node


# On each node: its address and interface toward the rendezvous, found by the package's own
# route lookup (a UDP connect sends nothing). gloo and NCCL would otherwise pick an interface from
# the hostname, which a cluster's nodes do not always resolve.
ROUTE_PY = """\
import sys
from ddp_notebook.platform.network import interface_of, source_address
address = source_address(sys.argv[1]) or "-"
print(address, (interface_of(address) if address != "-" else None) or "-")"""

NODE_FUNCTION = """\
run_node() {
    set -eu
    local route node_addr ifname is_host=0
    route=$("$PYTHON" -c "$ROUTE_PY" "$HEAD_ADDR")
    node_addr=${route% *}
    ifname=${route#* }
    if [ "$ifname" != "-" ]; then
        # a GLOO/NCCL_SOCKET_IFNAME of the world's environment wins, as in the notebook
        export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$ifname}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$ifname}"
    fi
    # the first node holds the rendezvous (torchrun would guess it from the hostname)
    if [ "$SLURMD_NODENAME" = "$HEAD_NODE" ]; then is_host=1; fi
    local where=()
    if [ "$node_addr" != "-" ]; then where=(--local-addr "$node_addr"); fi
    exec "$PYTHON" -m torch.distributed.run --nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC_PER_NODE" \\
        --rdzv-backend c10d --rdzv-endpoint "$HEAD_ADDR:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID" \\
        --rdzv-conf "is_host=$is_host" "${where[@]}" --max-restarts 0 --tee 3 "$SCRIPT"
}"""


def _sbatch_line(option: str, value: object) -> str:
    """`#SBATCH --option=value`: sbatch groups words in double quotes only (not single ones)."""
    text = str(value)
    if '"' in text or "\n" in text:
        raise DDPUsageError(f"--{option} cannot hold a double quote or a new line: {text!r}")
    return f'#SBATCH --{option}="{text}"' if any(c.isspace() for c in text) else f"#SBATCH --{option}={text}"


def render(spec: JobSpec) -> str:
    """The batch script's text (bash)."""
    options: list[tuple[str, object]] = [
        ("job-name", spec.name),
        ("nodes", spec.nodes),
        ("ntasks-per-node", 1),  # one torchrun per node; it starts the node's ranks
        ("cpus-per-task", spec.nproc_per_node * spec.threads),
    ]
    if spec.gpus_per_node:
        options.append(("gpus-per-node", spec.gpus_per_node))
    options += [(name, value) for name, value in (("time", spec.time_limit), ("partition", spec.partition)) if value]
    if spec.account:
        options.append(("account", spec.account))
    options += [("output", spec.log), ("chdir", spec.workdir)]
    world_env = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in spec.env.items())
    end = END_MARKER.format(job="$SLURM_JOB_ID", code="$status")
    return (
        "#!/bin/bash\n"
        + "".join(_sbatch_line(name, value) + "\n" for name, value in options)
        + f"# Written by %ddp_export --submit slurm: {spec.nodes} node(s) x {spec.nproc_per_node} rank(s), "
        f"{spec.backend}.\n"
        "# One srun task per node runs torchrun, which starts the node's ranks; the rendezvous is on\n"
        "# the allocation's first node. Every line of a rank starts with [rank N]: (its global rank),\n"
        "# srun --label puts the node's index before it.\n"
        "set -u\n\n"
        "# the world's settings, as the notebook's ranks had them\n"
        f"export DDP_BACKEND={spec.backend}\n"
        f"export OMP_NUM_THREADS={spec.threads}\n"
        "export PYTHONUNBUFFERED=1\n" + world_env + "export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank ${rank}]:'\n\n"
        f"PYTHON={shlex.quote(spec.python)}\n"
        f"SCRIPT={shlex.quote(spec.script)}\n"
        f"NPROC_PER_NODE={spec.nproc_per_node}\n"
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
        'HEAD_ADDR=$(scontrol show node "$HEAD_NODE" | tr " " "\\n" | sed -n "s/^NodeAddr=//p")\n'
        "HEAD_ADDR=${HEAD_ADDR:-$HEAD_NODE}\n"
        f"RDZV_PORT=$(({RDZV_BASE_PORT} + SLURM_JOB_ID % {RDZV_PORT_SPREAD}))\n"
        f"ROUTE_PY={shlex.quote(ROUTE_PY)}\n"
        "export PYTHON SCRIPT NPROC_PER_NODE HEAD_NODE HEAD_ADDR RDZV_PORT ROUTE_PY\n\n"
        + NODE_FUNCTION
        + "\nexport -f run_node\n\n"
        'echo "[ddp_notebook] job $SLURM_JOB_ID: $SLURM_NNODES node(s) x $NPROC_PER_NODE rank(s),'
        ' rendezvous at $HEAD_NODE ($HEAD_ADDR:$RDZV_PORT)"\n'
        "status=0\n"
        'srun --label --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 '
        f"--cpus-per-task={spec.nproc_per_node * spec.threads} --kill-on-bad-exit=1 bash -c run_node || status=$?\n"
        f'echo "{end}"\n'
        'exit "$status"\n'
    )
