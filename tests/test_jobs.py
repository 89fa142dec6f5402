"""Batch jobs from the notebook: `%ddp_export train.py --submit slurm` and `%ddp_jobs`.

Unit tests of the sbatch script and of the log's filter; misuse through a real IPython shell;
and a real job: cells run in a world driven from a real Jupyter kernel, submitted to a real
slurmctld with a slurmd on each of two network-namespace hosts (root only), its log followed
from the notebook, its weights compared with the cells'; a second job cancelled.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from IPython import get_ipython
from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython

from ddp_notebook import DDPCluster
from ddp_notebook.errors import DDPUsageError
from ddp_notebook.world import joblog, jobs, sbatch
from tests.support import multihost
from tests.support.docs_pages import documented_magic_lines
from tests.support.kernel import Kernel, kernel_world_pids
from tests.support.multihost import Network, SlurmCluster
from tests.support.processes import owned_pids, wait_gone

# the fixtures this module uses
multihost_network = multihost.multihost_network
multihost_slurm = multihost.multihost_slurm


# ---------------------------------------------------------------------------------- unit: the sbatch script


def spec(**options: Any) -> sbatch.JobSpec:
    return sbatch.JobSpec(
        **{
            "script": "/work/my notebooks/train.py",
            "log": "/work/my notebooks/train-%j.log",
            "workdir": "/work/my notebooks",
            "python": "/opt/env/bin/python3",
            "nodes": 2,
            "nproc_per_node": 1,
            "threads": 3,
            "env": {"DATA_DIR": "/data/set one", "TOKEN": "a'b"},
            "time_limit": "1:00:00",
            "partition": "gpu",
            **options,
        }
    )


def test_the_sbatch_script_runs_torchrun_once_per_node_with_the_worlds_settings() -> None:
    text = sbatch.render(spec())
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    directives = [line for line in lines if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=train",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=3",
        "#SBATCH --time=1:00:00",
        "#SBATCH --partition=gpu",
        '#SBATCH --output="/work/my notebooks/train-%j.log"',
        '#SBATCH --chdir="/work/my notebooks"',
    ]
    # the world's settings: gloo without GPUs, its threads, its environment (quoted)
    assert "export DDP_BACKEND=gloo\nexport OMP_NUM_THREADS=3\n" in text
    assert "export DATA_DIR='/data/set one'\n" in text and "export TOKEN='a'\"'\"'b'\n" in text
    # the rendezvous: the allocation's first node, the job's id, a port from it
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in text
    assert "--rdzv-backend c10d" in text and '--rdzv-id "$SLURM_JOB_ID"' in text
    assert '--nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC_PER_NODE"' in text
    assert "PYTHON=/opt/env/bin/python3\n" in text and 'exec "$PYTHON" -m torch.distributed.run' in text
    # every line attributable: the node's index from srun, the global rank from torchrun
    assert "srun --label" in text and "--tee 3" in text
    assert "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank ${rank}]:'" in text
    assert "--account" not in text and "--gpus-per-node" not in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True, timeout=10)  # bash reads it


def test_gpus_per_node_make_an_nccl_job_and_bad_values_are_refused() -> None:
    text = sbatch.render(spec(gpus_per_node=4, nproc_per_node=4, threads=1, account="proj"))
    assert "#SBATCH --gpus-per-node=4\n" in text and "#SBATCH --account=proj\n" in text
    assert "export DDP_BACKEND=nccl\n" in text and "NPROC_PER_NODE=4\n" in text
    with pytest.raises(DDPUsageError, match="--nodes must be >= 1"):
        spec(nodes=0)
    with pytest.raises(DDPUsageError, match="--time takes one word"):
        spec(time_limit="1 hour")
    with pytest.raises(DDPUsageError, match="environment variable"):
        spec(env={"NOT A NAME": "x"})


def test_each_node_finds_its_address_and_interface_toward_the_rendezvous() -> None:
    """The snippet each node runs (the package's own route lookup), run here for real."""
    run = subprocess.run(
        [sys.executable, "-c", sbatch.ROUTE_PY, "127.0.0.1"], capture_output=True, text=True, timeout=60, check=True
    )
    address, interface = run.stdout.split()
    assert address == "127.0.0.1" and interface.startswith("lo")


def world_stub(size: int, hosts: tuple[str, ...], backend: str = "gloo") -> Any:
    """What job_spec reads of a world (pure logic: no processes)."""
    config = SimpleNamespace(launch=SimpleNamespace(python="/py"), threads_per_rank=2, env={"A": "1"})
    return SimpleNamespace(world_size=size, hosts=hosts, backend=backend, config=config)


def test_a_job_has_the_cells_ranks_spread_over_the_worlds_hosts_by_default() -> None:
    made = jobs.job_spec(world_stub(4, ("h1", "h2")), "/w/train.py", workdir="/w")
    assert (made.nodes, made.nproc_per_node, made.backend, made.threads, made.python) == (2, 2, "gloo", 2, "/py")
    assert made.log == "/w/train-%j.log" and made.env == {"A": "1"}
    made = jobs.job_spec(world_stub(4, ("h1",), "nccl"), "/w/train.py", workdir="/w")
    assert (made.nodes, made.nproc_per_node, made.gpus_per_node, made.backend) == (1, 4, 4, "nccl")
    with pytest.raises(DDPUsageError, match="do not split evenly over 2 nodes"):
        jobs.job_spec(world_stub(3, ("h1",)), "/w/train.py", nodes=2)


# ---------------------------------------------------------------------------------- unit: the log

# the log of a 2-node job (1 rank each) whose rank 1 raised, as Slurm wrote it (trimmed)
FAILED_LOG = """\
[ddp_notebook] job 7: 2 node(s) x 1 rank(s), rendezvous at ddp-h1 (10.231.64.11:29507)
0: [W1126 07:20:31.850230254 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3
0: [rank 0]:/tmp/train.py:28: UserWarning: careful
0: [rank 0]:  warnings.warn('careful')
0: [rank 0]:epoch 0 loss 0.5
1: [rank 1]:epoch 0 loss 0.6
1: [rank 1]:/tmp/train.py:28: UserWarning: careful
1: [rank 1]:  warnings.warn('careful')
1: [rank 1]:not an error
1: [rank 1]:[rank1]: Traceback (most recent call last):
1: [rank 1]:[rank1]:   File "/tmp/train.py", line 32, in <module>
1: [rank 1]:[rank1]:     raise ValueError('boom on 1')
1: [rank 1]:[rank1]: ValueError: boom on 1
1: [rank 1]:after the error
1: E1126 07:20:40.108000 22256 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)
1: Root Cause (first observed failure):
1:   rank      : 1 (local_rank: 0)
srun: error: ddp-h2: task 1: Exited with exit code 1
[ddp_notebook] job 7 ended: exit code 1
"""


def test_the_log_shows_rank_0_and_every_ranks_errors_tagged_by_rank() -> None:
    keep = joblog.LogFilter()
    shown = [line for line in map(keep, FAILED_LOG.splitlines()) if line is not None]
    assert shown == [
        "[ddp_notebook] job 7: 2 node(s) x 1 rank(s), rendezvous at ddp-h1 (10.231.64.11:29507)",
        "[node 0] [W1126 07:20:31.850230254 socket.cpp:207] [c10d] The hostname of the client socket cannot be "
        "retrieved. err=-3",
        "[rank 0] /tmp/train.py:28: UserWarning: careful",
        "[rank 0]   warnings.warn('careful')",
        "[rank 0] epoch 0 loss 0.5",
        "[rank 1] /tmp/train.py:28: UserWarning: careful",
        "[rank 1]   warnings.warn('careful')",
        "[rank 1] Traceback (most recent call last):",
        '[rank 1]   File "/tmp/train.py", line 32, in <module>',
        "[rank 1]     raise ValueError('boom on 1')",
        "[rank 1] ValueError: boom on 1",
        "[node 1] E1126 07:20:40.108000 22256 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
        "(exitcode: 1)",
        "[node 1] Root Cause (first observed failure):",
        "[node 1]   rank      : 1 (local_rank: 0)",
        "srun: error: ddp-h2: task 1: Exited with exit code 1",
        "[ddp_notebook] job 7 ended: exit code 1",
    ]
    everything = joblog.LogFilter(everything=True)
    assert len([line for line in map(everything, FAILED_LOG.splitlines()) if line]) == len(FAILED_LOG.splitlines())
    assert joblog.parse("12: [rank 13]:x") == joblog.LogLine("x", rank=13, node=12)


def test_the_reader_gives_whole_lines_as_the_file_grows(tmp_path: Path) -> None:
    log = tmp_path / "train-1.log"
    reader = joblog.LogReader(str(log))
    assert list(reader.new_lines()) == []  # not written yet
    log.write_text("first\nsec")
    assert list(reader.new_lines()) == ["first"]
    with open(log, "a") as handle:
        handle.write("ond\nthird")
    assert list(reader.new_lines()) == ["second"]
    assert list(reader.rest()) == ["third"]


# ---------------------------------------------------------------------------------- misuse, in a real shell


@pytest.fixture(scope="module")
def shell() -> Iterator[Any]:
    ip = start_ipython() or get_ipython()
    ip.run_line_magic("load_ext", "ddp_notebook")
    yield ip
    ip.run_line_magic("unload_ext", "ddp_notebook")


def one_line(shell: Any, line: str) -> str:
    """Run `line`; it must fail with one UsageError line, fast, no traceback."""
    began = time.monotonic()
    result = shell.run_cell(line, store_history=False)
    assert time.monotonic() - began < 5.0
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    message = str(result.error_in_exec)
    assert "\n" not in message
    return message


@pytest.mark.integration
@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("%ddp_export train.py --submit pbs", "--submit takes slurm, got 'pbs'"),
        ("%ddp_export --submit slurm", "--submit needs the script to write: %ddp_export train.py --submit slurm"),
        ("%ddp_export train.py --nodes 2", "add --submit slurm"),
        ("%ddp_jobs --log 424242", "no job 424242 among this notebook's jobs"),
        ("%ddp_jobs --cancel 424242", "no job 424242 among this notebook's jobs"),
        ("%ddp_jobs --follow", "--follow, --all and --follow-timeout go with --log ID"),
        ("%ddp_jobs --log 1 --follow --follow-timeout 0", "--follow-timeout must be a number of seconds > 0"),
    ],
)
def test_misuse_of_the_job_magics_is_one_line(
    shell: Any, line: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the notebook's folder: no job records
    assert message in one_line(shell, line)


@pytest.mark.integration
def test_without_slurm_a_submit_is_one_line_and_writes_nothing(
    shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch on it
    DDPCluster(2, backend="gloo").activate()  # a world (not started): the magics drive it
    message = one_line(shell, "%ddp_export train.py --submit slurm --nodes 2")
    assert message.startswith("sbatch not found: Slurm's commands are not on this machine's PATH")
    assert list(tmp_path.iterdir()) == []
    shell.run_line_magic("ddp_stop", "")
    shell.run_line_magic("ddp_jobs", "")  # nothing submitted from this folder: no Slurm needed
    assert capsys.readouterr().out.splitlines()[-1] == (
        "no batch jobs submitted from this notebook's folder yet (%ddp_export train.py --submit slurm)"
    )


# ---------------------------------------------------------------------------------- a real job


CELLS = [
    # the model and the data, seeded: the job builds the same ones
    "%%ddp\n"
    "import os, warnings\n"
    "OUT = {out!r}\n"
    "torch.manual_seed(0)\n"
    "data = torch.utils.data.TensorDataset(torch.randn(96, 5), torch.randn(96, 1))\n"
    "model = ddp_notebook.prepare_model(torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), "
    "torch.nn.Linear(8, 1)))\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)\n"
    "loader = ddp_notebook.prepare_loader(data, batch_size=8)\n",
    # training; rank 1 warns once (an error line from a rank other than 0)
    "%%ddp\n"
    "for epoch in range(3):\n"
    "    for x, y in loader:\n"
    "        optimizer.zero_grad()\n"
    "        loss = torch.nn.functional.mse_loss(model(x), y)\n"
    "        loss.backward()\n"
    "        optimizer.step()\n"
    "    print(f'epoch {epoch} loss {loss.item():.6f} on {rank} of {world_size}')\n"
    "if rank == 1:\n"
    "    warnings.warn('rank 1 says: careful')\n",
    # the weights, from rank 0: the job writes its own file
    "%%ddp --ranks 0\n"
    "name = 'job.pt' if 'SLURM_JOB_ID' in os.environ else 'cells.pt'\n"
    "torch.save(model.module.state_dict(), os.path.join(OUT, name))\n"
    "print('saved', name)\n",
]

DOCS = Path(__file__).resolve().parent.parent / "docs" / "scaling_out.md"
DONE_SECONDS = 240  # a job here: ~20 s (2 s to schedule, torch imports on 2 cores, the rendezvous)


def closed(kernel: Kernel, pid: int) -> list[int]:
    """Shut the kernel down; the processes it started (ranks, the warm template) still alive after 30 s."""
    kernel.close()
    return wait_gone(sorted(owned_pids(pid) | {pid}), 30)


def documented_lines() -> list[str]:
    """The magic lines of docs/scaling_out.md's batch jobs section, as written there."""
    return documented_magic_lines(DOCS, "Batch jobs from the notebook")


def printed(kernel: Kernel, code: str, timeout: float = 120, ran: list[str] | None = None) -> str:
    if ran is not None:
        ran += [line for line in code.splitlines() if line.startswith("%")]
    out, error = kernel.run(code, timeout=timeout)
    assert error is None, out
    return out


def usage_error(kernel: Kernel, code: str) -> str:
    out, _ = kernel.run(code, timeout=30)
    lines = [line for line in re.sub(r"\x1b\[[0-9;]*m", "", out).splitlines() if line.strip()]
    # ipykernel shows a UsageError as one line on stderr
    assert len(lines) == 1 and lines[0].startswith("UsageError: "), out
    return lines[0]


@pytest.mark.integration
@pytest.mark.multihost
def test_cells_submitted_as_a_job_run_on_two_nodes_and_end_with_the_cells_weights(
    multihost_network: Network, multihost_slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torch

    for name, value in multihost_slurm.env.items():
        monkeypatch.setenv(name, value)  # as on a login node: sbatch, squeue, scancel read it
    # the namespace hosts reach no DNS server: one quick try per lookup, not 5 s x 2 (torchrun
    # looks its hostname up); the job gets the kernel's environment (sbatch --export=ALL)
    monkeypatch.setenv("RES_OPTIONS", "timeout:1 attempts:1")
    notebook = tmp_path / "my notebook"  # a space in its path: quoted everywhere it goes
    notebook.mkdir()
    monkeypatch.chdir(notebook)  # the kernel's folder: the job records, the scripts
    h1 = multihost_network[0]
    kernel = Kernel()
    kernel_pid = kernel.manager.provisioner.pid  # type: ignore[union-attr]
    world_pids: list[int] = []
    try:
        printed(kernel, "%load_ext ddp_notebook\n%ddp_start 2 --backend gloo")
        world_pids = kernel_world_pids(kernel)
        for cell in CELLS:
            printed(kernel, cell.replace("{out!r}", repr(str(tmp_path))))
        assert (tmp_path / "cells.pt").exists()

        ran: list[str] = []  # the magic lines run, to hold the docs to
        out = printed(kernel, "%ddp_export train.py --submit slurm --nodes 2 --partition ddp --time 10", ran=ran)
        found = re.search(r"submitted job (\d+) \(2 node\(s\) x 1 rank\(s\), gloo\)", out)
        assert found, out
        job = found[1]
        assert f"follow it with: %ddp_jobs --log {job} --follow" in out
        assert (notebook / "train.py").exists() and (notebook / "train.sbatch").exists()

        follow = f"%ddp_jobs --log {job} --follow --follow-timeout {DONE_SECONDS}"
        out = printed(kernel, follow, timeout=DONE_SECONDS + 30, ran=ran)
        lines = out.splitlines()
        assert lines[-1] == f"job {job} COMPLETED (exit code 0)", out
        # rank 0's lines, tagged; rank 1's only where they are warnings or errors
        assert [line for line in lines if "loss" in line] == [
            line for line in lines if line.startswith("[rank 0] epoch ") and line.endswith(" on 0 of 2")
        ], out
        assert len([line for line in lines if "loss" in line]) == 3, out
        assert "[rank 0] saved job.pt" in lines, out
        assert any(line.startswith("[rank 1] ") and "UserWarning: rank 1 says: careful" in line for line in lines), out
        assert not any(line.startswith("[rank 1] epoch") for line in lines), out
        assert f"[ddp_notebook] job {job} ended: exit code 0" in lines, out
        # it ran on both hosts, one rank each, the rendezvous on the first
        assert f"rendezvous at {h1.name} ({h1.address}:" in out, out
        log = (notebook / f"train-{job}.log").read_text()
        assert "0: [rank 0]:epoch 2" in log and "1: [rank 1]:epoch 2 " in log, log

        from_cells = torch.load(tmp_path / "cells.pt", weights_only=True)
        from_job = torch.load(tmp_path / "job.pt", weights_only=True)
        assert from_cells.keys() == from_job.keys()
        for name, value in from_cells.items():
            torch.testing.assert_close(from_job[name], value, rtol=1e-6, atol=1e-7)

        # the Python API: a second job, submitted from Python, cancelled by the magic
        out = printed(
            kernel,
            "from ddp_notebook.world import jobs\n"
            "world = get_ipython().magics_manager.registry['DDPMagics'].world\n"
            "again = jobs.submit_job(world, 'again.py', nodes=2, partition='ddp', time_limit='10')\n"
            "print(again.job_id, again.nodes, again.nproc_per_node, again.backend)\n"
            f"print(jobs.follow_log({job}, follow=True).describe())  # ended: its lines at once, then how\n",
        )
        second, *shape = out.splitlines()[0].split()
        assert shape == ["2", "1", "gloo"], out
        assert "[rank 0] saved job.pt" in out and out.splitlines()[-1] == f"job {job} COMPLETED (exit code 0)", out
        out = printed(kernel, f"%ddp_jobs --cancel {second}", ran=ran)
        assert out.strip() == f"job {second} CANCELLED", out
        assert multihost_slurm.wait_for_empty_queue(60) == []
        listing = printed(kernel, "%ddp_jobs", ran=ran)
        rows = {row.split()[0]: row.split()[1] for row in listing.splitlines()}
        assert rows == {job: "COMPLETED", second: "CANCELLED"}, listing
        missing = [line for line in documented_lines() if line not in ran]
        assert missing == [], f"documented in {DOCS.name} but not run as written (ran: {ran})"

        # bad input: one line each
        assert "--submit takes slurm, got 'pbs'" in usage_error(kernel, "%ddp_export x.py --submit pbs")
        assert f"no job 99{job}" in usage_error(kernel, f"%ddp_jobs --log 99{job}")
        assert "exists; pass --force" in usage_error(kernel, "%ddp_export train.py --submit slurm --nodes 2")
        printed(kernel, "%%ddp\n%time y = 1")  # IPython syntax: fine in a cell, not in a script
        said = usage_error(kernel, "%ddp_export bad.py --submit slurm --nodes 2 --partition ddp")
        assert "cell 4 is not plain Python (line 1: %time y = 1)" in said, said
        assert not (notebook / "bad.py").exists() and not (notebook / "bad.sbatch").exists()
        assert "sbatch failed: Batch job submission failed: Invalid partition name specified" in usage_error(
            kernel, "%ddp_export other.py --submit slurm --nodes 2 --partition nosuch --cells 1-3"
        )
        assert not (notebook / "other.py").exists(), "a refused job leaves no script behind"
        printed(kernel, "%ddp_stop")
    finally:
        left = closed(kernel, kernel_pid)
    assert left == [] and wait_gone(world_pids, 30) == []
    assert multihost_slurm.wait_for_empty_queue(30) == []

    # the records outlive the kernel: a new one lists both jobs
    records = json.loads((notebook / jobs.RECORDS_FILE).read_text())["jobs"]
    assert [(r["job_id"], r["state"]) for r in records] == [(job, "COMPLETED"), (second, "CANCELLED")]
    monkeypatch.delenv("SLURM_CONF")  # the jobs ended: listing them asks Slurm nothing
    kernel = Kernel()
    kernel_pid = kernel.manager.provisioner.pid  # type: ignore[union-attr]
    try:
        listing = printed(kernel, "%load_ext ddp_notebook\n%ddp_jobs")
        assert [row.split()[:2] for row in listing.splitlines()] == [[job, "COMPLETED"], [second, "CANCELLED"]]
        assert str(notebook / f"train-{job}.log") in listing
    finally:
        left = closed(kernel, kernel_pid)
    assert left == []
    assert os.path.exists(notebook / "train.sbatch")
