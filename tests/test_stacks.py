"""Unit tests: reading faulthandler dumps into one line per rank."""

from __future__ import annotations

from ddp_notebook.wire.stacks import describe_stuck_rank, main_thread_frames

DUMP = """Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in run

Current thread 0x00007f0000000001 (most recent call first):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 2810 in all_reduce
  File "/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/tmp/ipykernel_123/456.py", line 5 in <module>
  File "/site-packages/IPython/core/interactiveshell.py", line 3577 in run_code
"""


def test_main_thread_is_picked_out() -> None:
    frames = main_thread_frames(DUMP, 0x7F0000000001)
    assert frames[0] == ("/site-packages/torch/distributed/distributed_c10d.py", 2810, "all_reduce")
    assert len(frames) == 4
    assert main_thread_frames(DUMP, 0x1234) == []


def test_a_rank_in_a_collective() -> None:
    frames = main_thread_frames(DUMP, 0x7F0000000001)
    assert describe_stuck_rank(frames) == "waiting in torch.distributed.all_reduce (at cell line 5)"


def test_a_rank_elsewhere_and_an_idle_rank() -> None:
    busy = [("/tmp/ipykernel_1/2.py", 9, "<module>")]
    assert describe_stuck_rank(busy) == "running <module> (at cell line 9), never reached the collective"
    idle = [("/usr/lib/python3.11/selectors.py", 468, "select")]
    assert describe_stuck_rank(idle) == "idle (not running a cell)"
    assert describe_stuck_rank([]) == "no stack (the rank did not answer)"


def test_a_rank_in_a_collective_started_from_cpp_is_waiting_not_running() -> None:
    # DDP's gradient all-reduce starts inside backward: no torch.distributed frame, but the
    # rank's X-ray sees its collective under way
    backward = [
        ("/site-packages/torch/autograd/graph.py", 829, "_engine_run_backward"),
        ("/site-packages/torch/autograd/__init__.py", 347, "backward"),
        ("/tmp/ipykernel_1/3.py", 5, "<module>"),
    ]
    assert describe_stuck_rank(backward, in_flight=True) == (
        "waiting in a collective started by _engine_run_backward (at cell line 5)"
    )
    assert describe_stuck_rank(backward) == (
        "running _engine_run_backward (at cell line 5), never reached the collective"
    )
