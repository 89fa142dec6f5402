"""The magics, driven through a real IPython InteractiveShell."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from IPython import get_ipython
from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython

from tests.support.processes import wait_gone

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def shell() -> Iterator[object]:
    ip = start_ipython() or get_ipython()
    ip.run_line_magic("load_ext", "ddp_notebook")
    yield ip
    ip.run_line_magic("unload_ext", "ddp_notebook")


def run(shell: object, source: str) -> object:
    return shell.run_cell(source, store_history=False)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("%ddp_start 0", "number of ranks must be >= 1"),
        ("%ddp_start -1", "number of ranks must be >= 1"),
        ("%ddp_start two", "'two' is not a number of ranks"),
        ("%ddp_start 2.5", "'2.5' is not a number of ranks"),
        ("%ddp_start 2 --backend nccl", "needs GPUs"),
        ("%ddp_start 2 --backend mpi", "--backend must be one of"),
        ("%ddp_start 2 --collective-timeout 0", "timeout must be a number of seconds"),
        ("%ddp_start 2 --max-restarts -1", "max restarts must be >= 0"),
        ("%ddp_resize", "%ddp_resize needs the number of ranks"),
        ("%ddp_resize two", "'two' is not a number of ranks"),
        ("%ddp_start 2 --frobnicate", "unrecognized arguments"),
        ("%ddp_status", "no DDP world is running"),
        ("%ddp_stop now", "takes no arguments"),
        ("%ddp_rollback now", "%ddp_rollback takes no arguments"),
        ("%ddp_rollback", "no DDP world is running"),
        ("%ddp_autoreload off", "no DDP world is running"),
        ("%ddp_sync", "no DDP world is running"),
        ("%ddp_sync --max-mb lots", "argument --max-mb: invalid float value: 'lots'"),
        ("%ddp_restart", "no DDP world to restart"),
        ("%ddp_start 2 --launcher yarn", "launcher must be one of local, mpi, slurm, ssh"),
        ("%ddp_start 2 --launcher mpi --hosts a,b", "--hosts is for the ssh launcher; this world uses --launcher mpi"),
        ("%ddp_start --launcher mpi", "say how many ranks to start with the mpi launcher"),
        ("%ddp_start 2 --launcher mpi --gpus 0,1", "--gpus chooses GPUs of this machine"),
        ("%ddp_start 5 --launcher ssh --hosts a:2,b:2", "5 ranks asked for but the ssh hosts list has slots for 4"),
        ("%ddp_start 2 --launcher ssh --hosts a:x", "cannot read host 'a:x'"),
        ("%ddp_start 2 --launcher slurm --config qos=high", "write Class.trait=value"),
        ("%ddp_attach /nonexistent/ipcontroller-client.json", "no cluster connection file at /nonexistent"),
        (
            "%ddp_attach --ipp-profile /nonexistent-profile --cluster-id c1",
            "ipcontroller-c1-client.json: is the cluster",
        ),
        ("%ddp_attach -n two", "'two' is not a number of ranks"),
        # worlds that cannot fit this machine (cores or memory), GPUs it does not have
        ("%ddp_start 100 --backend gloo", "100 CPU ranks do not fit here"),
        ("%ddp_start 2 --gpus 98,99 --backend gloo", "visible"),
        # --force reaches the checks: past the fit, the next one speaks
        ("%ddp_start 100 --backend gloo --force --collective-timeout 0", "timeout must be a number of seconds"),
        ('%ddp_start --launcher ssh --hosts a:1 --ssh-args "-i KEY', "close every quote you open"),
    ],
)
def test_misuse_is_one_clear_line_and_starts_nothing(
    shell: object, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    began = time.monotonic()
    result = run(shell, line)
    assert time.monotonic() - began < 1.0
    assert isinstance(result.error_in_exec, UsageError)  # type: ignore[attr-defined]
    assert message in str(result.error_in_exec)  # type: ignore[attr-defined]
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert shell.magics_manager.registry["DDPMagics"].world is None  # type: ignore[attr-defined]


def test_ddp_cell_before_start(shell: object) -> None:
    result = run(shell, "%%ddp\nprint(rank)")
    assert isinstance(result.error_in_exec, UsageError)  # type: ignore[attr-defined]
    assert "%ddp_start" in str(result.error_in_exec)  # type: ignore[attr-defined]


def test_stop_with_nothing_running_is_harmless(shell: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(shell, "%ddp_stop").success  # type: ignore[attr-defined]
    assert "nothing to stop" in capsys.readouterr().out


def test_loading_twice_is_harmless(shell: object) -> None:
    magics = shell.magics_manager.registry["DDPMagics"]  # type: ignore[attr-defined]
    run(shell, "%load_ext ddp_notebook")
    run(shell, "%reload_ext ddp_notebook")
    assert shell.magics_manager.registry["DDPMagics"] is not None  # type: ignore[attr-defined]
    assert "ddp" in shell.magics_manager.magics["cell"]  # type: ignore[attr-defined]
    del magics


@pytest.mark.core
def test_a_session_from_start_to_stop(shell: object, capsys: pytest.CaptureFixture[str]) -> None:
    result = run(shell, "%ddp_start 2 --max-restarts 1")
    assert result.success, result.error_in_exec  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert "DDP world ready: 2 ranks, gloo" in out
    assert out.splitlines()[1].split() == ["rank", "host", "pid", "device", "backend"]
    world = shell.magics_manager.registry["DDPMagics"].world  # type: ignore[attr-defined]
    pids = world.all_pids
    try:
        # same size again: nothing to do; another size: told to stop first
        assert run(shell, "%ddp_start 2 --max-restarts 1").success  # type: ignore[attr-defined]
        assert "already running" in capsys.readouterr().out
        other = run(shell, "%ddp_start 1")
        assert isinstance(other.error_in_exec, UsageError) and "--restart" in str(other.error_in_exec)  # type: ignore[attr-defined]

        assert run(shell, "%%ddp\nx = rank + 100\nprint('x is', x)\nx").success  # type: ignore[attr-defined]
        out = capsys.readouterr().out
        assert "[rank 0] x is 100" in out and "[rank 1] x is 101" in out
        assert "[rank 0] Out: 100" in out and "[rank 1] Out: 101" in out

        assert run(shell, "%%ddp --ranks 1 --no-stream\nprint('later', x)").success  # type: ignore[attr-defined]
        assert capsys.readouterr().out.strip() == "[rank 1] later 101"

        failing = run(shell, "%%ddp\nif rank == 0:\n    1 / 0")
        assert isinstance(failing.error_in_exec, Exception)  # type: ignore[attr-defined]
        err = capsys.readouterr()
        text = err.out + err.err
        assert "rank 0 failed first (root cause)" in text and "ZeroDivisionError" in text
        assert "ddp_notebook/cluster.py" not in text  # the remote traceback, not ours

        bad_syntax = run(shell, "%%ddp\nfor i in range(2)\n    pass")
        assert bad_syntax.error_in_exec is not None  # type: ignore[attr-defined]
        assert "nothing was sent to the ranks" in "".join(capsys.readouterr())

        assert isinstance(run(shell, "%%ddp --ranks 5\nx").error_in_exec, UsageError)  # type: ignore[attr-defined]
        assert isinstance(run(shell, "%%ddp --timeout -1\nx").error_in_exec, UsageError)  # type: ignore[attr-defined]

        assert run(shell, "%ddp_status").success  # type: ignore[attr-defined]
        status = capsys.readouterr().out
        assert "healthy" in status and status.count(" idle ") == 2

        # a rank dies: the cell says which and how, and a new process takes its place (--max-restarts 1)
        assert run(shell, "%%ddp --setup\nsetup_made = rank").success  # type: ignore[attr-defined]
        died = run(shell, "%%ddp\nimport os\nif rank == 1:\n    os._exit(3)")
        assert type(died.error_in_exec).__name__ == "RankDiedError"  # type: ignore[attr-defined]
        assert "rank 1 exited with code 3. Rank 1 came back in " in "".join(capsys.readouterr())
        assert run(shell, "%%ddp\nprint(setup_made, 'x' in globals())").success  # type: ignore[attr-defined]
        out = capsys.readouterr().out
        assert "[rank 0] 0 True" in out and "[rank 1] 1 False" in out  # the setup cell replayed, x only kept on 0
        # past --max-restarts: the world is broken, and %ddp_restart brings a full world back
        died = run(shell, "%%ddp\nimport os\nif rank == 1:\n    os._exit(3)")
        assert "max_restarts=1" in str(died.error_in_exec)  # type: ignore[attr-defined]
        capsys.readouterr()
        broken = run(shell, "%%ddp\nx")
        assert isinstance(broken.error_in_exec, UsageError) and "%ddp_restart" in str(broken.error_in_exec)  # type: ignore[attr-defined]
        assert run(shell, "%ddp_status").success  # type: ignore[attr-defined]
        status = capsys.readouterr().out
        assert "broken (rank 1 gone): %ddp_restart" in status and " gone " in status
        assert run(shell, "%ddp_restart").success  # type: ignore[attr-defined]
        assert "DDP world ready: 2 ranks" in capsys.readouterr().out
        pids += world.all_pids
        assert run(shell, "%%ddp\nrank").success  # type: ignore[attr-defined]
        assert "[rank 1] Out: 1" in capsys.readouterr().out
    finally:
        assert run(shell, "%ddp_stop").success  # type: ignore[attr-defined]
    assert "stopped the world of 2 ranks" in capsys.readouterr().out
    assert wait_gone(pids) == []


def test_unload_stops_the_world(shell: object) -> None:
    ip = shell  # type: ignore[assignment]
    assert ip.run_cell("%ddp_start 1").success
    pids = ip.magics_manager.registry["DDPMagics"].world.all_pids
    ip.run_line_magic("unload_ext", "ddp_notebook")
    assert "DDPMagics" not in ip.magics_manager.registry
    assert "ddp" not in ip.magics_manager.magics["cell"]
    assert wait_gone(pids) == []
    ip.run_line_magic("load_ext", "ddp_notebook")  # leave the shared shell as the module fixture expects


def test_a_world_built_in_python_is_driven_by_the_magics(shell: object, capsys: pytest.CaptureFixture[str]) -> None:
    from ddp_notebook import DDPCluster, WorldConfig

    magics = shell.magics_manager.registry["DDPMagics"]  # type: ignore[attr-defined]
    world = DDPCluster(WorldConfig.build(2, backend="gloo", collective_timeout=60)).start()
    pids = world.all_pids
    try:
        assert world.activate() is world and magics.world is world
        assert world.recorder is magics.recorder  # %ddp_metrics sees what this world's ranks log
        assert run(shell, "%%ddp\nprint('from python-built world', rank)").success  # type: ignore[attr-defined]
        assert "[rank 1] from python-built world 1" in capsys.readouterr().out
        assert run(shell, "%ddp_status").success  # type: ignore[attr-defined]
        assert "world of 2 ranks (gloo): healthy" in capsys.readouterr().out
        # a world the magics started is not silently replaced
        assert run(shell, "%ddp_stop").success  # type: ignore[attr-defined]
        assert not world.running and wait_gone(pids) == []
        assert run(shell, "%ddp_start 1").success  # type: ignore[attr-defined]
        started = magics.world
        other = DDPCluster(1, backend="gloo")
        with pytest.raises(Exception, match="started with %ddp_start is running: %ddp_stop it first"):
            other.activate()
        assert magics.world is started
        pids += started.all_pids
    finally:
        world.stop()
        run(shell, "%ddp_stop")
    assert wait_gone(pids) == []


@pytest.mark.parametrize(
    ("line", "launcher", "expected"),
    [
        # quoted, as a shell reads it: ssh gets each word, not one argument with the quotes
        (
            '--launcher ssh --hosts a:1,b:1 --ssh-args "-i KEY -o StrictHostKeyChecking=no"',
            "SSHLauncher",
            {"ssh_args": ["-i", "KEY", "-o", "StrictHostKeyChecking=no"]},
        ),
        (
            '--launcher ssh --hosts a:1 --ssh-args="-F ~/.ssh/cluster_config"',
            "SSHLauncher",
            {"ssh_args": ["-F", "~/.ssh/cluster_config"]},
        ),
        ("--launcher ssh --hosts a:1 --ssh-args '-p 2222'", "SSHLauncher", {"ssh_args": ["-p", "2222"]}),
        (
            '2 --launcher mpi --mpi-args "--hostfile hosts -x A=b"',
            "MPIEngineSetLauncher",
            {"mpi_args": ["--hostfile", "hosts", "-x", "A=b"]},
        ),
        ("2 --launcher mpi --mpi-args=--oversubscribe", "MPIEngineSetLauncher", {"mpi_args": ["--oversubscribe"]}),
        (
            "2 --launcher slurm --config SlurmEngineSetLauncher.qos=high "
            '--config "SlurmEngineSetLauncher.batch_template_file=/my jobs/t.sh"',
            "SlurmEngineSetLauncher",
            {"qos": "high", "batch_template_file": "/my jobs/t.sh"},
        ),
    ],
)
def test_options_with_arguments_reach_the_launcher_as_typed(
    line: str, launcher: str, expected: dict[str, object]
) -> None:
    """What %ddp_start would start from this line (checked, nothing started): the same words as
    DDPCluster(..., ssh_args=[...]) gives."""
    from ddp_notebook.magics import start_config

    settings, restart = start_config(line)
    assert not restart
    assert {trait: settings.launch.settings[launcher][trait] for trait in expected} == expected


def test_a_slurm_world_that_replaces_lost_ranks_as_the_docs_start_it() -> None:
    """docs/scaling_out.md: `%ddp_start 8 --launcher slurm --partition gpu --time 2:00:00 --on-loss replace`."""
    from ddp_notebook.magics import start_config

    settings, _ = start_config("8 --launcher slurm --partition gpu --time 2:00:00 --on-loss replace")
    assert settings.n_ranks == 8 and settings.on_loss == "replace"
    slurm = settings.launch.settings["SlurmEngineSetLauncher"]
    assert (slurm["queue"], slurm["timelimit"]) == ("gpu", "2:00:00")


def test_an_ssh_world_with_spare_slots_as_the_docs_start_it() -> None:
    """docs/scaling_out.md: `%ddp_start 4 --launcher ssh --hosts node1:2,node2:2,node3:2 --on-loss
    replace --ip ...`: four ranks, two spare slots, lost ranks replaced (the address: this machine's)."""
    from ddp_notebook.magics import start_config

    settings, _ = start_config("4 --launcher ssh --hosts node1:2,node2:2,node3:2 --on-loss replace --ip 127.0.0.1")
    assert settings.n_ranks == 4 and settings.on_loss == "replace"
    assert settings.launch.settings["SSHEngineSetLauncher"]["engines"] == {"node1": 2, "node2": 2, "node3": 2}


def test_the_old_spellings_read_as_the_new_ones_and_the_help_shows_only_the_new() -> None:
    from ddp_notebook.magics import magic, parse_line, start_config

    new, _ = start_config("2 --collective-timeout 7 --ipp-profile P --launcher mpi")
    assert (new.timeout, new.launch.profile) == (7.0, "P")
    assert start_config("2 --timeout 7 --profile P --launcher mpi")[0] == new
    assert start_config("2 --timeout=7 --profile=P --launcher mpi")[0] == new
    jobs = parse_line(magic("ddp_jobs"), "--log 3 --follow --timeout 30")
    assert (jobs.log, jobs.follow, jobs.follow_timeout) == ("3", True, 30.0)
    for name, old in (("ddp_start", "--timeout"), ("ddp_start", "--profile"), ("ddp_jobs", "--timeout")):
        assert old not in magic(name).parser.format_help().split(), (name, old)
    # %%ddp's own --profile (torch.profiler) and --timeout (the cell's limit) are no old spellings
    cell = parse_line(magic("ddp"), "--profile 3 --timeout 9")
    assert (cell.profile, cell.timeout) == ("3", 9.0)


def test_an_empty_line_gives_the_defaults_each_time_as_a_fresh_namespace() -> None:
    from ddp_notebook.magics import magic, parse_line

    for name in ("ddp", "ddp_start", "ddp_jobs"):
        first, second = parse_line(magic(name), ""), parse_line(magic(name), "  ")
        assert vars(first) == vars(second) == vars(magic(name).parser.parse_args([]))
        assert first is not second
        first.changed = True  # what one cell changes in its arguments is not the next one's
        assert not hasattr(parse_line(magic(name), ""), "changed")
    assert parse_line(magic("ddp"), "").timeout is None and parse_line(magic("ddp"), "--timeout 5").timeout == 5.0


def test_ddp_start_mirrors_world_config_build() -> None:
    """Each option of %ddp_start is a keyword of WorldConfig.build (or a launcher shortcut of it), with its
    default; what only Python can give (an environment, a target to attach to, ...) is the rest."""
    import inspect

    from ddp_notebook.magics import magic, parse_line
    from ddp_notebook.magics.arguments import TRACKER_OPTIONS, build_options
    from ddp_notebook.world import launchers
    from ddp_notebook.world.config import WorldConfig

    given = build_options(parse_line(magic("ddp_start"), ""), "n", "restart", *TRACKER_OPTIONS)
    parameters = inspect.signature(WorldConfig.build).parameters.values()
    build = {parameter.name for parameter in parameters if parameter.kind is inspect.Parameter.KEYWORD_ONLY}
    taken = build | set(launchers.SHORTCUTS)
    assert set(given) <= taken, sorted(set(given) - taken)
    # timeout= and profile=: the old names of collective_timeout= and ipp_profile=, with a warning
    assert taken - set(given) == {"env", "attach", "autoreload", "simulated", "timeout", "profile"}
    assert WorldConfig.build(2, **given) == WorldConfig.build(2)  # the magic's defaults are Python's
