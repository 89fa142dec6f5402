"""A pdb prompt on one rank, answered through a real Jupyter kernel's stdin channel."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.kernel import Kernel

pytestmark = pytest.mark.integration


def run_answering(
    kernel: Kernel, code: str, answers: list[str], timeout: float = 120, interrupt_at_prompt: int | None = None
) -> tuple[str, str | None, list[str]]:
    """Run `code` with stdin allowed, answering each prompt with the next answer (or interrupting
    the kernel at prompt number `interrupt_at_prompt`); returns (printed text, error name, prompts)."""
    prompts: list[str] = []
    pending = list(answers)

    def answer(prompt: str) -> str | None:
        prompts.append(prompt)
        if interrupt_at_prompt is not None and len(prompts) == interrupt_at_prompt:
            return None
        return pending.pop(0)

    text, error = kernel.run(code, timeout, on_prompt=answer)
    return text, error, prompts


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    kernel = Kernel()
    try:
        # strict mode on: the sessions below run with every collective checked first
        out, error = kernel.run("%load_ext ddp_notebook\n%ddp_start 2 --check-collectives")
        assert error is None and "strict mode: every collective of the default group is checked" in out, out
        yield kernel
    finally:
        try:
            kernel.run("%ddp_stop", timeout=60)
        finally:
            kernel.close()


CELL = (
    "%%ddp\n"
    "x = rank * 10\n"
    "ddp_notebook.breakpoint(rank=1)\n"
    "y = x + 1\n"
    "t = torch.ones(1)\n"
    "dist.all_reduce(t)\n"
    "print('after', y, t.item())\n"
)


def test_break_on_rank_1_print_step_continue(kernel: Kernel) -> None:
    out, error, prompts = run_answering(kernel, CELL, ["p x", "n", "p y", "c"])
    assert error is None, out
    assert prompts == ["[rank 1] (Pdb) "] * 4
    assert "[rank 1] -> y = x + 1" in out  # stopped on rank 1 at the line after the breakpoint
    assert "[rank 1] 10\n" in out  # p x
    assert "[rank 1] -> t = torch.ones(1)" in out  # n
    assert "[rank 1] 11\n" in out  # p y, after the step
    # after c, both ranks went on through the collective (rank 0 waited without timing out)
    assert "[rank 0] after 1 2.0" in out and "[rank 1] after 11 2.0" in out


def test_quit_ends_the_cell_on_every_rank_and_the_next_cell_works(kernel: Kernel) -> None:
    out, error, prompts = run_answering(kernel, CELL, ["q"])
    assert prompts == ["[rank 1] (Pdb) "]
    assert error == "RankError", out
    assert "DebuggerQuit" in out and "after" not in out  # neither rank ran on past the breakpoint
    # the root cause is the rank that quit, its traceback the cell's line and no frame of pdb's
    assert "rank 1 failed first (root cause):" in out and "bdb.py" not in out and "cmd.py" not in out, out
    out, error = kernel.run("%%ddp\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nprint('sum', t.item())")
    assert error is None and "[rank 0] sum 3.0" in out and "[rank 1] sum 3.0" in out, out


def test_an_unanswered_prompt_gives_way_to_an_interrupt(kernel: Kernel) -> None:
    out, error, prompts = run_answering(kernel, CELL, [], interrupt_at_prompt=1, timeout=60)
    assert prompts == ["[rank 1] (Pdb) "]
    assert error is not None and "after" not in out, out
    out, error = kernel.run("%%ddp\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nprint('sum', t.item())")
    assert error is None and "[rank 1] sum 3.0" in out, out


def test_post_mortem_on_the_failing_rank(kernel: Kernel) -> None:
    out, error = kernel.run("%%ddp\ndef f(v):\n    w = v * 2\n    return 1 / (w - w)\nif rank == 0:\n    f(rank + 3)")
    assert error == "RankError"
    out, error, prompts = run_answering(kernel, "%ddp_debug", ["p w", "q"])
    assert error is None, out
    assert prompts[0] == "[rank 0] (Pdb) "
    assert "ZeroDivisionError" in out and "return 1 / (w - w)" in out
    assert "[rank 0] 6\n" in out  # w on rank 0, the root cause


def test_strict_mode_stops_a_size_mismatch_before_gloo_sees_it(kernel: Kernel) -> None:
    # without strict mode gloo aborts the receiving rank's process on this one
    out, error = kernel.run("%%ddp\nx = torch.ones(5 + rank)\ndist.all_reduce(x)")
    assert error == "RankError", out
    assert "collective mismatch caught before it ran (nothing was sent)" in out
    assert "rank 0 calls all_reduce(float32[5]); rank 1 calls all_reduce(float32[6])" in out
    out, error = kernel.run("%%ddp\ny = torch.ones(2)\ndist.all_reduce(y)\nprint('still', y.tolist(), x.shape[0])")
    assert error is None and "[rank 1] still [2.0, 2.0] 6" in out, out
    assert "set up again" not in out  # nothing broke: no heal was needed
