"""Unit tests: settings are checked before anything starts."""

from __future__ import annotations

import pytest

from ddp_notebook.errors import DDPUsageError
from ddp_notebook.platform import devices, network
from ddp_notebook.world.config import DEFAULT_COLLECTIVE_TIMEOUT, WorldConfig, parse_rank_count, parse_ranks


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "visible_gpus", lambda: ())
    monkeypatch.setattr(devices, "usable_cpus", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(devices, "memory_limit", lambda: None)  # this machine's memory plays no part here


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "visible_gpus", lambda: ("0", "1", "2", "3"))
    monkeypatch.setattr(devices, "usable_cpus", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(devices, "memory_limit", lambda: None)  # this machine's memory plays no part here


@pytest.mark.parametrize("text", ["0", "-1", "two", "2.5", ""])
def test_bad_rank_counts_say_what_to_type(text: str) -> None:
    with pytest.raises(DDPUsageError, match=r"%ddp_start 2"):
        parse_rank_count(text)


def test_rank_count_parses() -> None:
    assert parse_rank_count("4") == 4


def test_cpu_defaults(cpu_only: None) -> None:
    cfg = WorldConfig.build()
    assert (cfg.n_ranks, cfg.backend, cfg.gpus) == (4, "gloo", ())
    assert cfg.threads_per_rank == 2  # 8 cores shared by 4 ranks: no oversubscription


def test_cpu_threads_follow_user_setting(cpu_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert WorldConfig.build(2).threads_per_rank == 3


def test_gpu_defaults_one_rank_per_gpu(four_gpus: None) -> None:
    cfg = WorldConfig.build()
    assert (cfg.n_ranks, cfg.backend, cfg.gpus, cfg.threads_per_rank) == (4, "nccl", ("0", "1", "2", "3"), 1)
    assert WorldConfig.build(2).gpus == ("0", "1")


def test_more_ranks_than_gpus_is_refused(four_gpus: None) -> None:
    with pytest.raises(DDPUsageError, match="only 4 GPU"):
        WorldConfig.build(6)
    with pytest.raises(DDPUsageError, match="only 4 GPU"):
        WorldConfig.build(6, backend="nccl")


def test_gloo_on_a_gpu_machine_runs_cpu_ranks(four_gpus: None) -> None:
    cfg = WorldConfig.build(6, backend="gloo")
    assert (cfg.backend, cfg.gpus) == ("gloo", ())


def test_explicit_gpus(four_gpus: None) -> None:
    cfg = WorldConfig.build(gpus="2,3")
    assert (cfg.n_ranks, cfg.gpus, cfg.backend) == (2, ("2", "3"), "nccl")
    with pytest.raises(DDPUsageError, match="not visible"):
        WorldConfig.build(gpus="7")
    with pytest.raises(DDPUsageError, match="3 ranks need 3 GPUs"):
        WorldConfig.build(3, gpus="0,1")
    with pytest.raises(DDPUsageError, match="its own GPU"):
        WorldConfig.build(gpus="1,1")


def test_nccl_without_gpus(cpu_only: None) -> None:
    with pytest.raises(DDPUsageError, match="needs GPUs"):
        WorldConfig.build(2, backend="nccl")


def test_unknown_backend(cpu_only: None) -> None:
    with pytest.raises(DDPUsageError, match="backend must be one of"):
        WorldConfig.build(2, backend="mpi")


@pytest.mark.parametrize("timeout", [0, -5, float("nan"), "10"])
def test_bad_timeouts(cpu_only: None, timeout: object) -> None:
    with pytest.raises(DDPUsageError, match="seconds"):
        WorldConfig.build(2, collective_timeout=timeout)  # type: ignore[arg-type]


def test_strict_mode_is_a_world_setting_the_magic_passes_through(cpu_only: None) -> None:
    from IPython.core.magic_arguments import parse_argstring

    from ddp_notebook.magics.arguments import TRACKER_OPTIONS, build_options
    from ddp_notebook.magics.core import DDPMagics

    assert WorldConfig.build(2).check_collectives is False
    assert WorldConfig.build(2, check_collectives=True).check_collectives is True
    for line, strict in (("2 --check-collectives", True), ("2", False)):
        args = parse_argstring(DDPMagics.ddp_start, line)
        options = build_options(args, "n", "restart", *TRACKER_OPTIONS)
        assert WorldConfig.build(2, **options).check_collectives is strict


def test_config_is_frozen(cpu_only: None) -> None:
    cfg = WorldConfig.build(2)
    with pytest.raises(AttributeError):
        cfg.n_ranks = 3  # type: ignore[misc]
    assert isinstance(cfg, WorldConfig)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("0", (0,)), ("0,2", (0, 2)), ("1-3", (1, 2, 3)), ("all", (0, 1, 2, 3)), (" 3, 1 ", (1, 3)), ("0-1,1", (0, 1))],
)
def test_parse_ranks(spec: str, expected: tuple[int, ...]) -> None:
    assert parse_ranks(spec, 4) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("7", "this world has ranks 0-3"),
        ("-1", "rank -1 does not exist"),
        ("a", "cannot read ranks"),
        ("3-1", "backwards"),
    ],
)
def test_parse_ranks_errors(spec: str, message: str) -> None:
    with pytest.raises(DDPUsageError, match=message):
        parse_ranks(spec, 4)


def test_visible_gpus_reads_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert devices.visible_gpus() == ("3", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,2")  # CUDA ignores everything after an invalid entry
    assert devices.visible_gpus() == ("0",)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.visible_gpus() == ()


def test_listening_beyond_loopback_turns_curve_on(cpu_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (WorldConfig.build(2).master_addr, WorldConfig.build(2).curve) == ("127.0.0.1", False)
    assert WorldConfig.build(2, curve=True).curve is True
    monkeypatch.setattr(network, "interface_of", lambda address: "eth7" if address == "10.1.2.3" else None)
    cfg = WorldConfig.build(2, ip="10.1.2.3")
    assert (cfg.master_addr, cfg.curve) == ("10.1.2.3", True)
    with pytest.raises(DDPUsageError, match="not an IPv4 address of this machine"):
        WorldConfig.build(2, ip="10.9.9.9")
    with pytest.raises(DDPUsageError, match="needs an IP address"):
        WorldConfig.build(2, ip="my-laptop")
    with pytest.raises(DDPUsageError, match="needs CurveZMQ"):
        WorldConfig(n_ranks=2, backend="gloo", master_addr="10.1.2.3", curve=False)


def test_several_mig_instances_are_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    migs = ("MIG-1b2c3d4e-0000-0000-0000-000000000001", "MIG-1b2c3d4e-0000-0000-0000-000000000002")
    monkeypatch.setattr(devices, "visible_gpus", lambda: migs)
    with pytest.raises(DDPUsageError, match="cannot be MIG slices"):
        WorldConfig.build(2)


def test_the_old_keywords_of_the_world_still_work_with_a_deprecation_warning(cpu_only: None) -> None:
    """`timeout=` and `profile=` were the collective timeout and the ipyparallel profile; they are
    `collective_timeout=` and `ipp_profile=` now, as the magics' flags (a cell's `timeout=` and
    `profile=` are its time limit and its profiler)."""
    with pytest.warns(
        DeprecationWarning, match=r"timeout= is now collective_timeout= \(as the magics' --collective-timeout\)"
    ):
        old = WorldConfig.build(2, timeout=45)
    assert old == WorldConfig.build(2, collective_timeout=45)
    assert old.timeout == 45
    with pytest.warns(DeprecationWarning, match=r"profile= is now ipp_profile="):
        old = WorldConfig.build(2, profile="cluster7")
    assert old.launch.profile == "cluster7" == WorldConfig.build(2, ipp_profile="cluster7").launch.profile
    with pytest.raises(TypeError, match=r"give collective_timeout= \(the new name of timeout=\), not both"):
        WorldConfig.build(2, timeout=45, collective_timeout=45)
    assert WorldConfig.build(2).timeout == DEFAULT_COLLECTIVE_TIMEOUT


def test_the_old_keywords_warning_points_at_the_users_line(cpu_only: None) -> None:
    """Given to DDPCluster (which calls build) or to build itself, the warning names the caller's
    file: the package's own warnings are errors in this suite, a user's are theirs to see."""
    from ddp_notebook import DDPCluster

    for make in (lambda: WorldConfig.build(2, timeout=45), lambda: DDPCluster(2, timeout=45)):
        with pytest.warns(DeprecationWarning) as caught:
            make()
        assert [w.filename for w in caught] == [__file__]
