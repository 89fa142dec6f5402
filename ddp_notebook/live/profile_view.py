"""A profiled cell's report, as the notebook shows it: one timeline with a lane per rank on the
common clock, each rank's breakdown, top ops, overlap, idle time and memory, the straggler, and
where the traces are. A plotly figure and HTML tables under a kernel; text elsewhere."""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .durations import milliseconds
from .hta_analysis import HtaBreakdown
from .profile_analysis import CATEGORIES, ProfileAnalysis, Segment

COLORS = {
    "compute": "#1f77b4",
    "communication": "#d62728",
    "data": "#ff7f0e",
    "optimizer": "#2ca02c",
    "idle": "#c7c7c7",
}
BARS_PER_LANE = 1500  # a lane's stretches shorter than its span / this are merged into the one before
TOP_SHOWN = 5


@dataclass
class ProfileReport:
    """What `%%ddp --profile` found: `figure()`, `memory_figure()`, `describe()`, `analysis`
    (per rank: `analysis.ranks[r]`), `straggler`, and `files` (rank -> its Chrome trace)."""

    folder: Path
    files: dict[int, Path]
    analysis: ProfileAnalysis
    settings_text: str = ""
    notes: list[str] = field(default_factory=list)
    hta: HtaBreakdown | None = None

    @property
    def straggler(self) -> Any:
        return self.analysis.straggler

    def lanes(self) -> dict[str, list[Segment]]:
        """Each lane of the timeline (`rank N`, `rank N comm`, `rank N GPU`), thinned for drawing."""
        out: dict[str, list[Segment]] = {}
        for rank, r in sorted(self.analysis.ranks.items()):
            out[f"rank {rank}"] = _thin(r.host)
            out[f"rank {rank} comm"] = _thin(r.collectives)
            if r.gpu:
                out[f"rank {rank} GPU"] = _thin(r.gpu)
        return out

    def figure(self) -> Any:
        """The timeline: a lane per rank (its training thread: compute, communication, data wait,
        optimizer, idle), one of its collectives under it, and its GPU's where it has one; x in ms
        on the common clock."""
        import plotly.graph_objects as go

        origin = self.analysis.origin
        lanes = self.lanes()
        fig = go.Figure()
        for category in CATEGORIES:
            ys, bases, widths = [], [], []
            for lane, segments in lanes.items():
                for s in segments:
                    if s.category == category:
                        ys.append(lane)
                        bases.append((s.start - origin) * 1000)
                        widths.append((s.end - s.start) * 1000)
            fig.add_trace(
                go.Bar(
                    y=ys,
                    x=widths,
                    base=bases,
                    orientation="h",
                    name=category,
                    marker={"color": COLORS[category], "line": {"width": 0}},
                    hovertemplate=f"{category}: %{{x:.3f}} ms at %{{base:.3f}} ms<extra>%{{y}}</extra>",
                )
            )
        title = "profiled steps on the common clock"
        if self.straggler is not None:
            title += f": rank {self.straggler.rank} is the straggler ({self.straggler.phase})"
        fig.update_layout(
            barmode="overlay",
            bargap=0.25,
            title=title,
            xaxis_title="ms",
            yaxis={"autorange": "reversed", "categoryorder": "array", "categoryarray": list(lanes)},
            height=120 + 36 * len(lanes),
            legend={"orientation": "h"},
            margin={"l": 90, "r": 20, "t": 50, "b": 40},
        )
        return fig

    def memory_figure(self) -> Any:
        """Each rank's memory after every profiled step: resident memory, and CUDA allocated and
        reserved on GPUs."""
        import plotly.graph_objects as go

        fig = go.Figure()
        for rank, r in sorted(self.analysis.ranks.items()):
            for key, label, dash in (
                ("cpu_rss", "CPU resident", "solid"),
                ("cuda_allocated", "CUDA allocated", "dot"),
                ("cuda_reserved", "CUDA reserved", "dash"),
            ):
                points = [(m["step"], m[key]) for m in r.memory if m.get(key) is not None]
                if points:
                    fig.add_trace(
                        go.Scatter(
                            x=[p[0] for p in points],
                            y=[p[1] / 2**20 for p in points],  # type: ignore[operator]
                            mode="lines+markers",
                            name=f"rank {rank} {label}",
                            line={"dash": dash},
                        )
                    )
        fig.update_layout(title="memory after each optimizer step", xaxis_title="step", yaxis_title="MiB", height=320)
        return fig

    # ------------------------------------------------------------------ text and tables

    def rows(self) -> list[dict[str, Any]]:
        """One row per rank: ms per step by category, overlap, idle, memory peaks, how its clock was set."""
        rows = []
        for rank, r in sorted(self.analysis.ranks.items()):
            row: dict[str, Any] = {"rank": rank, "steps": len(r.steps), "step ms": r.step_seconds * 1000}
            row.update({f"{c} ms": r.per_step(c) * 1000 for c in CATEGORIES})
            row["comm overlapping compute"] = r.overlap
            row["GPU idle ms"] = r.gpu_idle * 1000 if r.gpu_idle is not None else None
            for key, label in (("cpu_rss", "peak RSS MiB"), ("cuda_allocated", "peak CUDA allocated MiB")):
                values = [m[key] for m in r.memory if m.get(key) is not None]
                row[label] = max(values) / 2**20 if values else None  # type: ignore[type-var,operator]
            reserved = [m["cuda_reserved"] for m in r.memory if m.get("cuda_reserved") is not None]
            row["peak CUDA reserved MiB"] = max(reserved) / 2**20 if reserved else None  # type: ignore[type-var,operator]
            row["clock"] = r.clock
            rows.append(row)
        return rows

    @property
    def verdict(self) -> str:
        """The straggler and why, or, with two ranks or more timed and none clearly slower, that none is."""
        if self.straggler is not None:
            return str(self.straggler.describe())
        busy = [r.busy for r in self.analysis.ranks.values() if r.steps]
        if len(busy) < 2:
            return ""
        return (
            f"no straggler: every rank spends {milliseconds(min(busy), unit=False)} to {milliseconds(max(busy))} "
            "per step outside communication"
        )

    def describe(self) -> str:
        """The report as text (a script's or a terminal's view)."""
        lines = [f"[profile] {self.settings_text}; traces in {self.folder}"]
        verdict = self.verdict
        if verdict:
            lines.append(f"[profile] {verdict}")
        for row, r in zip(self.rows(), (self.analysis.ranks[k] for k in sorted(self.analysis.ranks))):
            parts = ", ".join(f"{c} {row[f'{c} ms']:.1f}" for c in CATEGORIES)
            overlap = f"{row['comm overlapping compute']:.0%}" if row["comm overlapping compute"] is not None else "n/a"
            memory = f", peak RSS {row['peak RSS MiB']:.0f} MiB" if row["peak RSS MiB"] is not None else ""
            if row["peak CUDA allocated MiB"] is not None:
                memory += f", CUDA {row['peak CUDA allocated MiB']:.0f} MiB allocated"
                memory += f" / {row['peak CUDA reserved MiB']:.0f} MiB reserved"
            lines.append(
                f"[profile] rank {row['rank']}: {row['step ms']:.1f} ms/step over {row['steps']} steps ({parts} ms); "
                f"communication overlapping compute {overlap}{memory}"
            )
            top = "; ".join(f"{op.name} {milliseconds(op.self_seconds, digits=2)}" for op in r.top_ops[:TOP_SHOWN])
            lines.append(f"[profile] rank {row['rank']} top ops by self time per step: {top}")
        for rank, path in sorted(self.files.items()):
            lines.append(f"[profile] rank {rank}: {path}")
        lines += [f"[profile] {note}" for note in self.notes]
        if self.hta is not None and self.hta.note:
            lines.append(f"[profile] {self.hta.note}")
        return "\n".join(lines)

    def tables_html(self) -> str:
        folder = html.escape(str(self.folder))
        parts = [
            f"<p><b>profile</b>: {html.escape(self.settings_text)}; traces in <code>{folder}</code> "
            "(open them in Perfetto or TensorBoard's profiler view)</p>"
        ]
        verdict = self.verdict
        if verdict:
            style = " style='color:#d62728'" if self.straggler is not None else ""
            parts.append(f"<p{style}>{html.escape(verdict)}</p>")
        parts.append(_table(self.rows()))
        for rank, r in sorted(self.analysis.ranks.items()):
            ops = [
                {"op": op.name, "on": op.device, "self ms/step": op.self_seconds * 1000, "calls/step": op.calls}
                for op in r.top_ops
            ]
            parts.append(f"<p>rank {rank}: top ops by self time</p>{_table(ops)}")
        if self.hta is not None:
            for title, rows in (
                ("HTA temporal breakdown", self.hta.temporal),
                ("HTA communication/computation overlap", self.hta.overlap),
                ("HTA idle time", self.hta.idle),
            ):
                if rows:
                    parts.append(f"<p>{title}</p>{_table(rows)}")
        notes = [*self.notes, *([self.hta.note] if self.hta is not None and self.hta.note else [])]
        parts += [f"<p>{html.escape(note)}</p>" for note in notes]
        return "\n".join(parts)

    def _ipython_display_(self) -> None:
        show(self)

    def __repr__(self) -> str:
        return self.describe()


def show(report: ProfileReport) -> None:
    """The figures and tables in a notebook, the text elsewhere."""
    from .widgets import widget_frontend

    if not widget_frontend():
        print(report.describe())
        return
    from IPython.display import HTML, display

    if report.analysis.ranks:
        display(report.figure())
        if any(r.memory for r in report.analysis.ranks.values()):
            display(report.memory_figure())
    display(HTML(report.tables_html()))


def _thin(segments: list[Segment]) -> list[Segment]:
    """Stretches too short to see merged into the one before them (the drawing only)."""
    if not segments:
        return []
    least = (segments[-1].end - segments[0].start) / BARS_PER_LANE
    out = [segments[0]]
    for s in segments[1:]:
        last = out[-1]
        if s.end - s.start < least or (s.category == last.category and s.start - last.end < least):
            out[-1] = Segment(last.start, max(last.end, s.end), last.category)
        else:
            out.append(s)
    return out


def _table(rows: list[Mapping[str, Any]]) -> str:
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row.values()) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.1f}"
    return html.escape(str(value))
