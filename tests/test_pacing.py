"""What a large world paces to keep the kernel and the controller under a core: the controller's
heartbeat, each rank's live-view batches, the running cell's collective X-ray. Small worlds keep
the pace they always had."""

from __future__ import annotations

from ddp_notebook.cell.relay import COLLECTIVES_CHECK_SECONDS, collectives_check_seconds
from ddp_notebook.wire.channel import FLUSH_SECONDS, MESSAGES_PER_SECOND, flush_seconds
from ddp_notebook.world.provisioning.controlled import HEARTBEAT_LIMIT_MS, HEARTBEAT_PERIOD_MS, heartbeat_period_ms


def test_the_controllers_heartbeat_slows_with_the_rank_count_and_keeps_its_limit() -> None:
    assert heartbeat_period_ms(None) == heartbeat_period_ms(2) == heartbeat_period_ms(64) == HEARTBEAT_PERIOD_MS == 100
    assert heartbeat_period_ms(65) == 102 and heartbeat_period_ms(128) == 200
    assert heartbeat_period_ms(1024) == 1600
    # beats answered a second, all ranks together, stay within 640 at every size
    for ranks in (2, 32, 33, 64, 128, 512, 1024, 4096):
        assert ranks * 1000 / heartbeat_period_ms(ranks) <= 640
    assert HEARTBEAT_LIMIT_MS // heartbeat_period_ms(1024) * heartbeat_period_ms(1024) >= 9_000


def test_each_rank_publishes_less_often_in_a_large_world() -> None:
    assert flush_seconds(2) == flush_seconds(100) == FLUSH_SECONDS
    assert flush_seconds(1024) == 1.024
    for ranks in (128, 512, 1024):
        assert ranks / flush_seconds(ranks) <= MESSAGES_PER_SECOND


def test_the_running_cells_xray_is_read_less_often_in_a_large_world() -> None:
    assert collectives_check_seconds(4) == collectives_check_seconds(32) == COLLECTIVES_CHECK_SECONDS
    assert collectives_check_seconds(1024) == 8.0
    for ranks in (64, 256, 1024):
        assert ranks / collectives_check_seconds(ranks) <= 32 / COLLECTIVES_CHECK_SECONDS  # rank readings a second


def test_the_controller_waits_for_a_registered_ranks_first_heartbeat_as_long_as_the_start_may_take() -> None:
    """ipyparallel drops a registered engine whose first heartbeat it has not heard within its
    registration timeout (30 s), without telling the engine: on a loaded machine a starved rank was
    left waiting as a rank of no world ("only 126 of 128 ranks registered")."""
    from ddp_notebook.world.config import DEFAULT_START_TIMEOUT
    from ddp_notebook.world.provisioning.controlled import REGISTRATION_SECONDS, registration_seconds

    assert registration_seconds(DEFAULT_START_TIMEOUT) == 90
    assert registration_seconds(300.5) == 301
    assert registration_seconds(5) == REGISTRATION_SECONDS == 30
