"""What this kernel's and the ranks' releases lack, said once at `%ddp_start`: never a feature lost
without a word.

Each side finds its own by feature, in its adapter: the ranks (torch) send their lines when they
join (`JoinReport.off_here`, from `rank.xray.off_here`), the kernel adds the live view's
(`live.plotly_adapter.missing_features`).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..wire import xray_messages
from ..wire.results import RankInfo

# the lines this kernel already said: a restart, or a second world, says only new ones
_SAID: set[str] = set()


def missing_features(ranks: Iterable[RankInfo] = ()) -> list[str]:
    """What is off here, one line each: the live view's (this kernel's plotly), then the ranks'."""
    from ..live.plotly_adapter import missing_features as live_view_missing

    lines = live_view_missing()
    for info in ranks:
        lines += [line for line in info.off_here if line not in lines]
    return lines


def not_yet_said(lines: Iterable[str]) -> list[str]:
    """The lines this kernel has not said yet (each is said once)."""
    new = [line for line in lines if line not in _SAID]
    _SAID.update(new)
    return new


def collectives_source(ranks: Iterable[RankInfo]) -> str:
    """Where the X-ray's collectives come from, as `%ddp_status` names it."""
    if any(xray_messages.OWN_RECORD_LIMIT in info.off_here for info in ranks):
        return "each rank's record of its torch.distributed calls"
    return "torch's flight recorder"
