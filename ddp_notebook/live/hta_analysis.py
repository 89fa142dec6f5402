"""Holistic Trace Analysis (PyPI `HolisticTraceAnalysis`, module `hta`) on the ranks' traces, where
it fits them: traces with GPU kernels.

HTA's temporal breakdown, idle-time breakdown and communication/computation overlap are computed
over GPU kernels (events on a CUDA stream; communication is a kernel named `ncclKernel...`).
A CPU/gloo trace has none: gloo's collectives are host annotations (`gloo:all_reduce` on gloo's
threads), so on it HTA 0.5 raises (temporal breakdown: IndexError; idle time: "No objects to
concatenate") or gives NaN (overlap). `profile_analysis` covers every trace; on GPU traces this
adds HTA's own figures beside it. An optional dependency: `pip install 'ddp_notebook[profile]'`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INSTALL = "pip install 'ddp_notebook[profile]'"


@dataclass
class HtaBreakdown:
    """HTA's per-rank figures (rows of plain values), or why there are none."""

    temporal: list[dict[str, Any]] = field(default_factory=list)  # idle/compute/non-compute time and shares
    overlap: list[dict[str, Any]] = field(default_factory=list)  # rank, comp_comm_overlap_pctg
    idle: list[dict[str, Any]] = field(default_factory=list)  # rank, stream, idle category, time
    note: str = ""


def available() -> bool:
    try:
        import hta  # noqa: F401
    except ImportError:
        return False
    return True


def gpu_breakdown(files: Mapping[int, Path]) -> HtaBreakdown:
    """HTA's temporal breakdown, comm/compute overlap and idle-time breakdown of traces with GPU kernels."""
    if not files:
        return HtaBreakdown(note="no trace to analyse")
    try:
        from hta.analyzers.breakdown_analysis import BreakdownAnalysis
        from hta.analyzers.communication_analysis import CommunicationAnalysis
        from hta.common.trace import Trace
    except ImportError:
        return HtaBreakdown(note=f"Holistic Trace Analysis is not installed ({INSTALL}): its GPU breakdown is left out")
    logging.getLogger("hta").setLevel(logging.WARNING)  # it logs every file it parses
    result = HtaBreakdown()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HTA 0.5 on pandas 3 warns of pandas' deprecations at every call
        try:
            trace = Trace(trace_files={rank: str(path) for rank, path in files.items()})
            # in this process: HTA's default forks a pool, which a kernel's threads make unsafe
            trace.load_traces(include_last_profiler_step=True, use_multiprocessing=False)
            result.temporal = _rows(BreakdownAnalysis.get_temporal_breakdown(trace, visualize=False))
            result.overlap = _rows(CommunicationAnalysis.get_comm_comp_overlap(trace, visualize=False))
            for rank in sorted(files):
                idle, _ = BreakdownAnalysis.get_idle_time_breakdown(trace, 30, rank, None, False, False, False)
                result.idle += _rows(idle)
        except Exception as failure:  # noqa: BLE001  (our own analysis stands without it)
            result.note = f"Holistic Trace Analysis could not read these traces: {type(failure).__name__}: {failure}"
    return result


def _rows(frame: Any) -> list[dict[str, Any]]:
    return [{str(k): _plain(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value
