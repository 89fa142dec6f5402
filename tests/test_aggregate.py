"""The aggregate live view of a large world (`live.aggregate`): plain data, checked against values
computed here independently with the statistics module over hand-made data. No cluster."""

from __future__ import annotations

import math
import random
import statistics
import time

import pytest

from ddp_notebook.live.aggregate import (
    AGGREGATE_ABOVE,
    HEAT_SLOTS,
    QUANTILE_VALUES,
    BandSeries,
    HeatMatrix,
    Outlier,
    StepHeat,
    band,
    count_ranks,
    outlier_ranks,
    rank_ranges,
    summarize_progress,
    wants_aggregate,
)
from ddp_notebook.live.feed import BarState, Metrics
from ddp_notebook.wire.channel import BarRun

# ---------------------------------------------------------------- names and counts


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([0, 1, 2, 3, 5, 7, 8, 9], "0-3, 5, 7-9"),
        ([], ""),
        ([4], "4"),
        ([4, 5], "4-5"),
        ([9, 3, 4, 3, 0, 9, 5], "0, 3-5, 9"),
        (range(1024), "0-1023"),
        ([1, 3, 5], "1, 3, 5"),
    ],
)
def test_rank_ranges(ranks: list[int], text: str) -> None:
    assert rank_ranges(ranks) == text


def test_rank_ranges_takes_any_iterable_once() -> None:
    assert rank_ranges(rank for rank in (2, 1, 0, 10)) == "0-2, 10"


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 ranks"), (1, "1 rank"), (2, "2 ranks"), (1023, "1,023 ranks"), (1_000_000, "1,000,000 ranks")],
)
def test_count_ranks(n: int, text: str) -> None:
    assert count_ranks(n) == text


def test_wants_aggregate_above_the_threshold_only() -> None:
    assert AGGREGATE_ABOVE == 16
    assert not wants_aggregate(1) and not wants_aggregate(16)
    assert wants_aggregate(17) and wants_aggregate(64) and wants_aggregate(1024)


# ---------------------------------------------------------------- progress


def bar(
    rank: int,
    n: int,
    rate: float | None = 1.0,
    *,
    level: int = 0,
    loop: int = 0,
    total: int | None = 400,
    state: BarRun = "running",
    desc: str = "batch",
) -> BarState:
    return BarState(rank, level, loop, desc, n=n, total=total, elapsed=1.0, state=state, rate=rate)


def bars_of(*states: BarState) -> dict[tuple[int, int], BarState]:
    return {(state.rank, state.level): state for state in states}


def test_summarize_progress_counts_median_extremes_and_the_slowest() -> None:
    ns = {0: 120, 1: 131, 2: 104, 3: 98, 4: 125, 5: 101, 6: 119, 7: 128}
    rates = {0: 4.0, 1: 4.4, 2: 3.4, 3: 3.1, 4: 4.1, 5: 3.3, 6: 3.9, 7: 4.2}
    bars = bars_of(*(bar(rank, n, rates[rank]) for rank, n in ns.items()))
    summary = summarize_progress(bars)
    assert summary is not None
    assert summary.ranks == 8 and summary.level == 0 and summary.desc == "batch"
    assert summary.minimum == min(ns.values()) == 98
    assert summary.maximum == max(ns.values()) == 131
    assert summary.median == statistics.median(ns.values())
    assert summary.total == 400 and summary.finished == 0
    assert [p.rank for p in summary.slowest] == [3, 5, 2]
    assert [(p.n, p.rate) for p in summary.slowest] == [(98, 3.1), (101, 3.3), (104, 3.4)]
    assert summary.laggard.rank == 3 and summary.fastest.rank == 1
    assert summary.describe() == (
        "8 ranks: 119.5 / 400 (median), min 98 (rank 3), max 131 (rank 1); "
        "slowest: rank 3 (98, 3.1 it/s), rank 5 (101, 3.3 it/s), rank 2 (104, 3.4 it/s)"
    )


def test_summarize_progress_breaks_ties_by_rate_then_rank() -> None:
    bars = bars_of(bar(0, 50, 2.0), bar(1, 50, 1.0), bar(2, 50, None), bar(3, 50, 1.0), bar(4, 60, 9.0))
    summary = summarize_progress(bars, slowest=4)
    assert summary is not None
    # no rate yet is the slowest; equal rates: the lower rank first
    assert [p.rank for p in summary.slowest] == [2, 1, 3, 0]
    assert summary.fastest.rank == 4
    assert summary.slowest[0].describe() == "rank 2 (50)"


def test_summarize_progress_fastest_tie_goes_to_the_higher_rate_then_the_lower_rank() -> None:
    summary = summarize_progress(bars_of(bar(5, 10, 2.0), bar(6, 10, 3.0), bar(7, 10, 3.0)))
    assert summary is not None and summary.fastest.rank == 6


def test_summarize_progress_one_level_only_and_none_without_bars() -> None:
    bars = bars_of(bar(0, 3, level=0, total=3), bar(1, 2, level=0, total=3), bar(0, 40, level=1), bar(1, 90, level=1))
    assert summarize_progress({}) is None
    assert summarize_progress(bars, level=2) is None
    outer = summarize_progress(bars, level=0)
    inner = summarize_progress(bars, level=1)
    assert outer is not None and inner is not None
    assert (outer.minimum, outer.maximum, outer.total) == (2, 3, 3)
    assert (inner.minimum, inner.median, inner.maximum) == (40, 65, 90)


def test_summarize_progress_one_rank() -> None:
    summary = summarize_progress(bars_of(bar(7, 12, 2.5, total=None)))
    assert summary is not None
    assert (summary.ranks, summary.minimum, summary.median, summary.maximum) == (1, 12, 12, 12)
    assert summary.total is None
    assert summary.laggard == summary.fastest == summary.slowest[0]
    assert summary.describe() == "1 rank: 12 (median), min 12 (rank 7), max 12 (rank 7); slowest: rank 7 (12, 2.5 it/s)"


def test_summarize_progress_most_common_total_finished_and_no_slowest() -> None:
    bars = bars_of(
        bar(0, 400, state="done"),
        bar(1, 400, state="done"),
        bar(2, 300),
        bar(3, 250, total=250, state="closed"),
        bar(4, 200, total=None),
    )
    summary = summarize_progress(bars, slowest=0)
    assert summary is not None
    assert summary.total == 400
    assert summary.finished == 3
    assert summary.slowest == ()
    assert summary.laggard.rank == 4  # named even when no slowest are asked for
    assert summary.describe() == "5 ranks: 300 / 400 (median), min 200 (rank 4), max 400 (rank 0), 3 finished"


def test_summarize_progress_a_rank_on_the_next_loop_is_ahead_not_slowest() -> None:
    # ranks 0-3 in epoch 2's batches (bar id 2), rank 4 already in epoch 3's (id 3, n 5), rank 5 still in epoch 1's
    bars = bars_of(
        bar(0, 300, loop=2), bar(1, 310, loop=2), bar(2, 320, loop=2), bar(3, 330, loop=2), bar(4, 5, loop=3),
        bar(5, 399, loop=1),
    )  # fmt: skip
    summary = summarize_progress(bars, slowest=2)
    assert summary is not None
    assert [p.rank for p in summary.slowest] == [5, 0]
    assert summary.fastest.rank == 4
    assert (summary.earlier, summary.later) == (1, 1)
    assert summary.median == statistics.median([310, 320])
    assert "1 rank on an earlier loop, 1 rank on a later loop" in summary.describe()


def test_summarize_progress_large_world_names_few() -> None:
    rng = random.Random(3)
    ns = {rank: rng.randrange(90, 140) for rank in range(1024)}
    summary = summarize_progress(bars_of(*(bar(rank, n, n / 30) for rank, n in ns.items())))
    assert summary is not None
    assert summary.ranks == 1024 and len(summary.slowest) == 3
    assert summary.median == statistics.median(ns.values())
    expected = sorted(ns, key=lambda rank: (ns[rank], rank))[:3]
    assert [p.rank for p in summary.slowest] == expected
    assert summary.describe().startswith("1,024 ranks: ")


# ---------------------------------------------------------------- band


def inclusive_deciles(values: list[float]) -> tuple[float, float]:
    if len(values) == 1:
        return values[0], values[0]
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return cuts[0], cuts[-1]


def expected_band(
    points: dict[int, list[tuple[float, float]]], budget: int, depth: int | None = None
) -> list[tuple[float, float, float, float, float, float, int]]:
    """(last step, median, low, high, min, max, count) per bucket, by brute force: every distinct
    step in order, cut into `budget` buckets of (nearly) equal counts of distinct steps."""
    distinct = sorted({step for pairs in points.values() for step, value in pairs if not math.isnan(value)})
    n = len(distinct)
    count = min(budget, n)
    rows = []
    for b in range(count):
        steps = distinct[b * n // count : (b + 1) * n // count]
        everything = [v for pairs in points.values() for s, v in pairs if s in set(steps) and not math.isnan(v)]
        latest = set(steps if depth is None else steps[-depth:])
        sample = [v for pairs in points.values() for s, v in pairs if s in latest and not math.isnan(v)]
        low, high = inclusive_deciles(sample)
        rows.append(
            (steps[-1], statistics.median(sample), low, high, min(everything), max(everything), len(everything))
        )
    return rows


def as_rows(series: BandSeries) -> list[tuple[float, float, float, float, float, float, int]]:
    return list(
        zip(series.steps, series.median, series.low, series.high, series.minimum, series.maximum, series.counts)
    )


def metrics_of(points: dict[int, list[tuple[float, float]]], name: str = "loss") -> Metrics:
    metrics = Metrics()
    for rank, pairs in points.items():
        metrics.add(rank, name, [step for step, _ in pairs], [value for _, value in pairs])
    return metrics


def assert_rows(actual: list[tuple[float, ...]], expected: list[tuple[float, ...]]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12), (got, want)


def test_band_one_point_per_step_while_under_budget() -> None:
    points = {
        0: [(0, 1.0), (1, 0.8), (2, 0.7)],
        1: [(0, 1.2), (1, 0.9), (2, 0.5)],
        2: [(0, 0.9), (1, 1.1), (2, 0.6)],
        3: [(0, 1.4), (1, 0.7), (2, 0.65)],
        4: [(0, 1.1), (1, 0.75), (2, 0.4)],
    }
    series = band(metrics_of(points), "loss")
    assert series.steps == [0, 1, 2]
    assert series.median == [statistics.median(v for p in points.values() for s, v in p if s == x) for x in (0, 1, 2)]
    assert_rows(as_rows(series), expected_band(points, 400))
    # the 10-90 % band sits within the extremes, the median within the band
    for row in as_rows(series):
        _, median, low, high, minimum, maximum, _ = row
        assert minimum <= low <= median <= high <= maximum


def test_band_ranks_behind_count_only_where_they_logged() -> None:
    # rank 2 is 2 steps behind, rank 3 far behind: step 4 is the median of ranks 0 and 1 only
    points = {
        0: [(s, 10.0 + s) for s in range(5)],
        1: [(s, 20.0 + s) for s in range(5)],
        2: [(s, 30.0 + s) for s in range(3)],
        3: [(s, 40.0 + s) for s in range(1)],
    }
    series = band(metrics_of(points), "loss")
    assert series.steps == [0, 1, 2, 3, 4]
    assert series.counts == [4, 3, 3, 2, 2]
    assert series.median[4] == statistics.median([14.0, 24.0])
    assert series.maximum[0] == 40.0 and series.maximum[1] == 31.0 and series.maximum[3] == 23.0
    assert_rows(as_rows(series), expected_band(points, 400))


def test_band_ranks_with_steps_of_their_own() -> None:
    # odd ranks log every other step, rank 5 explicit steps out of order, rank 6 shares nothing with anyone
    rng = random.Random(11)
    points: dict[int, list[tuple[float, float]]] = {}
    for rank in range(4):
        points[rank] = [(s, rng.gauss(0, 1)) for s in range(0, 30, 1 + rank % 2)]
    points[5] = [(s, rng.gauss(0, 1)) for s in (4, 2, 9, 7, 1)]
    points[6] = [(s + 0.5, rng.gauss(5, 1)) for s in range(0, 30, 3)]
    for budget in (400, 12, 5, 1):
        series = band(metrics_of(points), "loss", budget=budget)
        assert len(series) <= budget
        assert_rows(as_rows(series), expected_band(points, budget))


def test_band_many_patterns_of_steps() -> None:
    # 12 patterns of steps, none a prefix of another (more than band() reads as columns), 3 ranks each
    rng = random.Random(13)
    points = {
        rank: [(s + (rank % 12) / 100, rng.expovariate(1.0)) for s in range(0, 40 + rank % 12)] for rank in range(36)
    }
    depth = QUANTILE_VALUES // 36
    for budget in (400, 17):
        # 17 buckets of ~33 distinct steps: the quantiles see the latest `depth` of them
        expected = expected_band(points, budget, depth=depth)
        assert_rows(as_rows(band(metrics_of(points), "loss", budget=budget)), expected)


def test_band_bucketing_keeps_the_last_step_and_the_extremes() -> None:
    # 10 steps into 3 buckets: steps 0-2, 3-5, 6-9 (the first n * b // points cuts)
    points = {rank: [(s, float(rank + s)) for s in range(10)] for rank in range(3)}
    points[1][4] = (4, 99.0)  # a spike inside the middle bucket, at neither of its ends
    points[2][7] = (7, -50.0)
    series = band(metrics_of(points), "loss", budget=3)
    assert series.steps == [2, 5, 9]
    assert series.maximum == [4.0, 99.0, 11.0]
    assert series.minimum == [0.0, 3.0, -50.0]
    assert series.counts == [9, 9, 12]
    middle = [float(rank + s) for rank in range(3) for s in (3, 4, 5)]
    middle[1 * 3 + 1] = 99.0
    assert series.median[1] == statistics.median(middle)
    assert_rows(as_rows(series), expected_band(points, 3))


def test_band_is_bounded_by_the_budget() -> None:
    points = {rank: [(s, math.sin(s / 50) + rank) for s in range(1000)] for rank in range(20)}
    metrics = metrics_of(points)
    for budget in (1, 7, 400, 999, 1000, 5000):
        series = band(metrics, "loss", budget=budget)
        assert len(series) == min(budget, 1000)
        assert len(series.median) == len(series.low) == len(series.high) == len(series.counts) == len(series)
        assert series.steps[-1] == 999
        assert sum(series.counts) == 20 * 1000
        assert min(series.minimum) == min(v for p in points.values() for _, v in p)
        assert max(series.maximum) == max(v for p in points.values() for _, v in p)
    # 7 buckets of ~143 steps: the quantiles see each bucket's latest QUANTILE_VALUES // 20 steps
    assert_rows(as_rows(band(metrics, "loss", budget=7)), expected_band(points, 7, depth=QUANTILE_VALUES // 20))
    with pytest.raises(ValueError):
        band(metrics, "loss", budget=0)


def test_band_quantiles_from_the_latest_steps_of_a_crowded_bucket() -> None:
    # 4 ranks and quantile_values 8: the quantiles see each bucket's latest 2 steps, the extremes all of it
    rng = random.Random(5)
    points = {rank: [(s, rng.uniform(0, 10)) for s in range(60)] for rank in range(4)}
    points[3] = points[3][:-7]  # one rank behind
    series = band(metrics_of(points), "loss", budget=6, quantile_values=8)
    assert_rows(as_rows(series), expected_band(points, 6, depth=2))
    # and with the default, the whole bucket (10 steps x 4 ranks is under QUANTILE_VALUES)
    assert 40 < QUANTILE_VALUES
    assert_rows(as_rows(band(metrics_of(points), "loss", budget=6)), expected_band(points, 6))


def test_band_many_ranks_some_behind_matches_brute_force() -> None:
    # the live case: 40 ranks, most at the same step, a few behind by a few steps, one far behind
    rng = random.Random(7)
    points = {}
    for rank in range(40):
        length = 200 - (rng.randrange(0, 15) if rank % 3 else 0)
        points[rank] = [(s, rng.gauss(1.0 / (1 + s), 0.1)) for s in range(length)]
    points[17] = points[17][:23]
    metrics = metrics_of(points)
    for budget in (400, 50, 33):
        assert_rows(as_rows(band(metrics, "loss", budget=budget)), expected_band(points, budget))
    assert_rows(as_rows(band(metrics, "loss", budget=33, quantile_values=80)), expected_band(points, 33, depth=2))


def test_band_leaves_nan_out_and_keeps_inf() -> None:
    points = {
        0: [(0, 1.0), (1, math.nan), (2, 3.0)],
        1: [(0, 2.0), (1, 5.0), (2, math.inf)],
        2: [(0, 3.0), (1, 6.0), (2, 1.0)],
    }
    series = band(metrics_of(points), "loss")
    assert series.counts == [3, 2, 3]
    assert series.median == [2.0, 5.5, 3.0]
    assert series.maximum[2] == math.inf
    assert not any(math.isnan(value) for value in series.median + series.low + series.high)
    # a rank with nothing but NaN has no point at all
    only_nan = band(metrics_of({0: [(0, math.nan)], 1: [(1, 2.0)]}), "loss")
    assert only_nan.steps == [1] and only_nan.median == [2.0]


def test_band_one_rank_empty_metric_and_chosen_ranks() -> None:
    one = band(metrics_of({3: [(0, 2.0), (1, 4.0)]}), "loss")
    assert one.steps == [0, 1] and one.median == one.low == one.high == one.minimum == one.maximum == [2.0, 4.0]
    points = {0: [(0, 1.0)], 1: [(0, 3.0)], 2: [(0, 100.0)]}
    metrics = metrics_of(points)
    empty = band(metrics, "accuracy")
    assert len(empty) == 0 and empty == BandSeries()
    assert band(Metrics(), "loss") == BandSeries()
    chosen = band(metrics, "loss", ranks=[0, 1, 1, 9])
    assert chosen.median == [2.0] and chosen.maximum == [3.0] and chosen.counts == [2]


def test_band_does_not_change_the_metrics() -> None:
    points = {0: [(2, 1.0), (0, 5.0), (1, math.nan)], 1: [(0, 1.0)]}
    metrics = metrics_of(points)
    before = metrics.to_dict()
    band(metrics, "loss", budget=1)
    after = metrics.to_dict()
    assert before["step"] == after["step"] and before["rank"] == after["rank"]
    assert [v for v in before["value"] if v == v] == [v for v in after["value"] if v == v]


def large_metrics(ranks: int, steps: int, behind: bool) -> Metrics:
    rng = random.Random(1)
    metrics = Metrics()
    for rank in range(ranks):
        length = steps - rng.randrange(0, 50) if behind else steps
        if behind and rank == 17:
            length = 300
        metrics.add(rank, "loss", list(range(length)), [rng.random() + s * 0.001 for s in range(length)])
    return metrics


@pytest.mark.parametrize("behind", [False, True], ids=["same steps", "ranks behind"])
def test_band_of_1024_ranks_by_2000_steps_is_fast(behind: bool) -> None:
    metrics = large_metrics(1024, 2000, behind)
    seconds = math.inf
    for _ in range(2):  # the better of two: the first pays for what the second finds in the caches
        # this thread's CPU time: on a machine whose cores other processes keep busy (the suite's
        # other worker), the wall clock also counts the time band() waited for a core
        started = time.thread_time()
        series = band(metrics, "loss")
        seconds = min(seconds, time.thread_time() - started)
    assert len(series) == 400 and series.steps[-1] == 1999
    assert sum(series.counts) == len(metrics)
    assert seconds < 1.0, f"band() of 1,024 ranks x 2,000 steps took {seconds:.2f} s"


# ---------------------------------------------------------------- outliers


def latest(values: dict[int, float], name: str = "loss") -> Metrics:
    metrics = Metrics()
    for rank, value in values.items():
        metrics.add(rank, name, [0, 1], [123.0, value])  # only the latest value counts
    return metrics


def test_outlier_by_the_median_absolute_deviation() -> None:
    rng = random.Random(2)
    values = {rank: 0.4 + rng.uniform(-0.02, 0.02) for rank in range(64)}
    values[5] = 3.2
    found = outlier_ranks(latest(values), "loss")
    median = statistics.median(values.values())
    mad = statistics.median(abs(v - median) for v in values.values())
    assert [o.rank for o in found] == [5]
    assert found[0].value == 3.2 and found[0].median == median
    assert found[0].score == pytest.approx(0.6745 * (3.2 - median) / mad)
    assert found[0].describe() == f"rank 5: loss 3.2 vs median {median:.4g}"


def test_outliers_largest_score_first_and_limited() -> None:
    values = {rank: 1.0 + 0.01 * (rank % 5) for rank in range(30)}
    values.update({3: 9.0, 8: -20.0, 12: 5.0})
    found = outlier_ranks(latest(values), "loss", limit=2)
    assert [o.rank for o in found] == [8, 3]
    assert found[0].score < 0 < found[1].score
    assert [o.rank for o in outlier_ranks(latest(values), "loss")] == [8, 3, 12]
    assert outlier_ranks(latest(values), "loss", limit=0) == []
    # a higher threshold keeps only the furthest
    assert [o.rank for o in outlier_ranks(latest(values), "loss", threshold=500)] == [8]


def test_outliers_nan_and_inf_come_first() -> None:
    values = {rank: 0.5 + 0.001 * rank for rank in range(20)}
    values.update({4: 50.0, 9: math.nan, 2: math.inf})
    found = outlier_ranks(latest(values), "loss")
    assert [o.rank for o in found] == [2, 9, 4]
    assert found[0].score == math.inf and math.isnan(found[1].score)
    finite = [v for v in values.values() if math.isfinite(v)]
    assert found[2].median == statistics.median(finite)
    assert found[1].describe().startswith("rank 9: loss nan vs median ")


def test_outliers_fall_back_to_the_mean_absolute_deviation_when_mad_is_zero() -> None:
    # all-reduced values agree exactly on most ranks: the MAD is 0
    values = {rank: 0.25 for rank in range(10)}
    values[6] = 0.3
    found = outlier_ranks(latest(values), "loss")
    deviations = [abs(v - 0.25) for v in values.values()]
    assert statistics.median(deviations) == 0
    assert [o.rank for o in found] == [6]
    assert found[0].score == pytest.approx((0.3 - 0.25) / (1.2533 * statistics.fmean(deviations)))


def test_no_outliers_when_all_agree_one_rank_or_nothing_logged() -> None:
    assert outlier_ranks(latest({rank: 1.5 for rank in range(100)}), "loss") == []
    assert outlier_ranks(latest({0: 7.0}), "loss") == []
    assert outlier_ranks(latest({0: 1.0, 1: 100.0}), "loss") == []  # two ranks: neither is the odd one
    assert outlier_ranks(latest({0: 1.0}), "accuracy") == []
    assert outlier_ranks(Metrics(), "loss") == []


def test_only_nan_values_are_all_outliers() -> None:
    found = outlier_ranks(latest({0: math.nan, 1: math.nan}), "loss")
    assert [o.rank for o in found] == [0, 1]
    assert all(math.isnan(o.median) for o in found)
    assert isinstance(found[0], Outlier) and found[0].name == "loss"


# ---------------------------------------------------------------- step time heat map


def feed_steady(heat: StepHeat, rank: int, until: float, per_second: float, every: float = 0.5) -> None:
    for i in range(1, round(until / every) + 1):
        heat.add(rank, i * every, round(i * every * per_second))


def test_heat_of_a_steady_rank() -> None:
    heat = StepHeat()
    feed_steady(heat, 0, until=10.0, per_second=10)
    matrix = heat.matrix(columns=60)
    assert matrix.labels == ["0"] and matrix.worst == [0]
    assert len(matrix.values[0]) == len(matrix.edges) - 1 <= 60
    assert matrix.edges[0] == 0 and matrix.edges[-1] == pytest.approx(10.0)
    widths = {round(b - a, 9) for a, b in zip(matrix.edges, matrix.edges[1:])}
    assert len(widths) == 1  # equal bins
    assert matrix.values[0] == pytest.approx([0.1] * len(matrix.values[0]))
    assert matrix.cell_ranks == [[0] * len(matrix.values[0])]


def test_heat_columns_are_bounded_and_cover_the_latest_time() -> None:
    heat = StepHeat()
    feed_steady(heat, 0, until=3600.0, per_second=4, every=1.0)
    for columns in (1, 7, 60, 500):
        matrix = heat.matrix(columns=columns)
        assert 1 <= len(matrix.edges) - 1 <= columns
        assert matrix.edges[-1] >= 3600.0 > matrix.edges[-2]
        assert all(value == pytest.approx(0.25) for value in matrix.values[0] if value is not None)


def test_heat_spreads_a_long_silence_and_shows_none_where_no_step_completed() -> None:
    heat = StepHeat(slots=16, first_width=1.0)
    heat.add(0, 1.0, 10)  # 10 steps in the first second
    heat.add(0, 3.0, 10)  # none for 2 seconds
    heat.add(0, 11.0, 11)  # one step over the next 8
    matrix = heat.matrix(columns=16)
    assert matrix.edges == [float(j) for j in range(12)]
    expected: list[float | None] = [0.1, None, None] + [8.0] * 8
    assert matrix.values[0] == pytest.approx(expected)


def test_heat_keeps_what_merging_buckets_adds_up() -> None:
    # 10 steps/s until 100 s, then 5 steps/s until 400 s; 16 slots of 1 s double to 32 s
    heat = StepHeat(slots=16, first_width=1.0)
    for i in range(1, 401):
        heat.add(0, float(i), 10 * min(i, 100) + 5 * max(0, i - 100))
    assert heat.width == 32.0 and heat.buckets(0) <= 16
    matrix = heat.matrix(columns=100)
    assert matrix.edges == [32.0 * j for j in range(14)]
    row = matrix.values[0]
    assert row[:3] == pytest.approx([0.1] * 3)
    assert row[3] == pytest.approx(32 / (4 * 10 + 28 * 5))  # [96, 128): 4 s fast, 28 s slow
    assert row[4:12] == pytest.approx([0.2] * 8)
    assert row[12] == pytest.approx(0.2)  # [384, 416): the last 16 s


def test_heat_bands_many_ranks_and_names_the_worst() -> None:
    heat = StepHeat()
    for rank in range(40):
        for i in range(1, 21):  # a message every 0.5 s for 10 s
            t = i * 0.5
            if rank == 17:  # 10 steps/s, but 2 steps/s from 4 s to 6 s
                steps = 10 * min(t, 4) + 2 * max(0, min(t, 6) - 4) + 10 * max(0, t - 6)
            else:
                steps = 10 * t
            heat.add(rank, t, round(steps))
    matrix = heat.matrix(columns=20, rows=4)
    assert matrix.labels == ["0-9", "10-19", "20-29", "30-39"]
    assert len(matrix.values) == len(matrix.cell_ranks) == len(matrix.worst) == 4
    assert matrix.worst == [0, 17, 20, 30]  # a tie goes to the lowest rank
    assert matrix.edges == pytest.approx([0.5 * j for j in range(21)])
    slow = [j for j in range(20) if 4 <= matrix.edges[j] < 6]
    for j in range(20):
        if j in slow:
            assert matrix.values[1][j] == pytest.approx(0.5) and matrix.cell_ranks[1][j] == 17
        else:
            assert matrix.values[1][j] == pytest.approx(0.1)
        for row in (0, 2, 3):
            assert matrix.values[row][j] == pytest.approx(0.1)


def test_heat_bands_are_even_and_bounded() -> None:
    heat = StepHeat()
    for rank in range(1000):
        heat.add(rank, 1.0, 10 + rank)
    matrix = heat.matrix(rows=64)
    assert len(matrix.labels) == 64
    sizes = []
    for label in matrix.labels:
        first, last = (int(part) for part in label.split("-"))
        sizes.append(last - first + 1)
    assert sum(sizes) == 1000 and max(sizes) - min(sizes) <= 1
    # the worst of a band: its fewest steps over the same time, the band's lowest rank here
    assert matrix.worst[0] == 0 and matrix.cell_ranks[0][-1] == 0
    # as many rows as ranks or fewer: one row per rank
    assert heat.matrix(rows=1000).labels == [str(rank) for rank in range(1000)]


def test_heat_ranks_never_heard_from_ignored_messages_and_empty() -> None:
    assert StepHeat().matrix() == HeatMatrix()
    heat = StepHeat()
    feed_steady(heat, 0, until=2.0, per_second=10)
    heat.add(0, 1.0, 5)  # an older message: ignored
    heat.add(0, 3.0, 15)  # goes backwards in steps (another cell's): ignored
    heat.add(1, 2.0, 40)
    matrix = heat.matrix(columns=4, ranks=[0, 1, 2])
    assert matrix.labels == ["0", "1", "2"]
    assert matrix.values[0] == pytest.approx([0.1] * 4)
    assert matrix.values[1] == pytest.approx([0.05] * 4)
    assert matrix.values[2] == [None] * 4 and matrix.worst[2] is None
    assert heat.ranks == [0, 1] and heat.span == 2.0
    with pytest.raises(ValueError):
        StepHeat(slots=1)


def test_heat_steps_that_took_no_time_and_clocks_that_make_no_sense() -> None:
    heat = StepHeat()
    heat.add(0, 0.0, 4)  # a first message at t=0 with steps already done: counted, in the first bucket
    heat.add(0, -1.0, 9)  # before the start: ignored
    heat.add(1, -1.0, 9)
    heat.add(1, math.nan, 9)
    heat.add(1, math.inf, 9)
    heat.add(0, 1.0, 14)
    matrix = heat.matrix(columns=8)
    assert heat.ranks == [0] and heat.buckets(1) == 0
    assert matrix.edges == [0.125 * j for j in range(9)]
    assert matrix.values[0][0] == pytest.approx(0.125 / (4 + 10 / 8))
    assert matrix.values[0][1:] == pytest.approx([0.1] * 7)


def test_heat_memory_is_bounded_however_long_the_cell_runs() -> None:
    # 8 ranks at 10 messages a second for 10,000 s: 100,000 messages each
    heat = StepHeat()
    most = 0
    for i in range(1, 100_001):
        t = i * 0.1
        for rank in range(8):
            heat.add(rank, t, 3 * i + (i // 1000) * rank)
        if i % 5000 == 0:
            most = max(most, *(heat.buckets(rank) for rank in range(8)))
    assert most <= HEAT_SLOTS
    assert all(heat.buckets(rank) <= HEAT_SLOTS for rank in range(8))
    assert heat.width * HEAT_SLOTS > 10_000 >= heat.width * HEAT_SLOTS / 2
    matrix = heat.matrix()
    # rank 0 does 30 steps/s throughout: what was merged still adds up
    assert all(value == pytest.approx(1 / 30) for value in matrix.values[0])
    assert matrix.worst == list(range(8)) and matrix.values[7][-1] < matrix.values[0][-1]
