"""bench/serve_paired.py's ratios to vanilla, on wave figures made by hand (issue 17).

Each xmix (or second vanilla) wave is the vanilla wave next to it times a factor chosen here,
different per server instance, so every ratio the tables print is known in advance: the median
and interquartile range over all waves, and each instance's median."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import serve_paired  # noqa: E402

KEYS = ("ttft", "itl", "p99_itl", "e2e")


def waves(base: dict[str, float], factors: list[tuple[int, float]]) -> list[dict]:
    return [{**{k: base[k] * f for k in KEYS}, "instance": i} for i, f in factors]


def figures() -> dict[tuple[str, int], list[dict]]:
    base = {"ttft": 0.300, "itl": 0.020, "p99_itl": 0.030, "e2e": 1.5}
    # two instances of two waves each; vanilla's own waves differ, the ratios do not
    van = [(0, 1.0), (0, 1.1), (1, 0.9), (1, 1.0)]
    return {
        ("vanilla", 8): waves(base, van),
        # xmix unused: +1 % on instance 1, +3 % on instance 2
        ("unused", 8): waves(
            base, [(i, f * r) for (i, f), r in zip(van, (1.01, 1.01, 1.03, 1.03))]
        ),
        # an app on the xmix server: +5 % everywhere
        ("steer", 8): waves(base, [(i, f * 1.05) for i, f in van]),
        # the second vanilla server: -2 % on instance 1, +4 % on instance 2
        ("vanilla-again", 8): waves(
            base, [(i, f * r) for (i, f), r in zip(van, (0.98, 0.98, 1.04, 1.04))]
        ),
    }


def test_over_vanilla_rows_are_the_paired_ratios():
    rows = serve_paired.vanilla_rows(figures())
    # median of (1.01, 1.01, 1.03, 1.03) is 1.02, its quartiles 1.01 and 1.03; same per metric
    assert rows == [
        "| unused over vanilla: xmix deployed, no app used (concurrency 8) | "
        + " | ".join(["1.020 (1.01..1.03)"] * 4)
        + " |",
        "| control: vanilla-again over vanilla (concurrency 8) | "
        + " | ".join(["1.010 (0.98..1.04)"] * 4)
        + " |",
        "| steer over vanilla (concurrency 8) | " + " | ".join(["1.050 (1.05..1.05)"] * 4) + " |",
    ]


def test_each_instance_has_its_own_median():
    text = serve_paired.instance_table(figures())
    lines = text.splitlines()
    assert lines[2] == "| over vanilla | instance 1 | instance 2 |"
    assert lines[4] == "| unused (concurrency 8) | 1.010 / 1.010 | 1.030 / 1.030 |"
    assert lines[5] == "| vanilla-again (concurrency 8) | 0.980 / 0.980 | 1.040 / 1.040 |"


def test_the_full_table_puts_vanilla_first_and_the_over_vanilla_rows_next():
    got = figures()
    names = [line.split(" | ")[0] for line in serve_paired.table(got, []).splitlines()[2:]]
    assert names == [
        "| vanilla, concurrency 8 (ms)",
        "| unused, concurrency 8 (ms)",
        "| unused over vanilla: xmix deployed, no app used (concurrency 8)",
        "| control: vanilla-again over vanilla (concurrency 8)",
        "| steer over vanilla (concurrency 8)",
    ]
    # vanilla's medians in ms: waves at 1.0, 1.1, 0.9, 1.0 of the base -> median 1.0
    vanilla = serve_paired.table(got, []).splitlines()[2]
    assert vanilla == "| vanilla, concurrency 8 (ms) | 300.0 | 20.0 | 30.0 | 1500.0 |"


def test_every_configuration_has_its_instances_medians_after_the_servers_own_rows():
    lines = serve_paired.instance_table(figures()).splitlines()
    assert lines[6] == "| steer (concurrency 8) | 1.050 / 1.050 | 1.050 / 1.050 |"


def test_the_interval_of_a_median_holds_the_median_and_is_a_point_when_waves_agree():
    got = figures()
    text = serve_paired.interval_table(got)
    # steer is +5 % on every wave: every bootstrap median is 1.05
    assert "| steer (concurrency 8) | " + " | ".join(["1.050 [1.050, 1.050]"] * 3) + " |" in text
    # unused: ratios 1.01, 1.01, 1.03, 1.03; a resampled median lies in [1.01, 1.03]
    lo, hi = serve_paired.median_interval([1.01, 1.01, 1.03, 1.03])
    assert 1.01 <= lo <= 1.02 <= hi <= 1.03


def test_the_split_by_place_pairs_each_wave_with_the_vanilla_wave_of_its_turn():
    got = figures()
    # unused's waves 1 and 2 came first after a switch of server (ratios 1.01), 3 and 4 not
    # (1.03); steer's waves are not marked and get no row
    for w, flag in zip(got[("unused", 8)], (1.0, 1.0, 0.0, 0.0)):
        w["after_switch"] = flag
    lines = serve_paired.position_table(got).splitlines()
    row = next(line for line in lines if line.startswith("| unused"))
    assert row == "| unused (concurrency 8) | 1.010 (2) | 1.010 (2) | 1.030 (2) | 1.030 (2) |"
    assert not any(line.startswith("| steer") for line in lines)


def test_cpu_table_gives_each_process_its_median_and_its_ratio_to_vanilla():
    got = figures()
    # CPU ms per wave: vanilla's API server 100, 110, 90, 100; unused's 20 % more, wave by
    # wave; the engine core and the worker equal to vanilla's
    for (cfg, _), ws in got.items():
        for w, f in zip(ws, (1.0, 1.1, 0.9, 1.0)):
            api = 100 * f * (1.2 if cfg == "unused" else 1.0)
            w.update(cpu_api=api, cpu_core=50 * f, cpu_worker=400 * f)
    del got[("steer", 8)][0]["cpu_worker"]  # a wave without the figure leaves its row out
    lines = serve_paired.cpu_table(got).splitlines()
    assert lines[2] == "| vanilla (concurrency 8) | 100 | 50 | 400 | - | - | - |"
    assert lines[3] == "| unused (concurrency 8) | 120 | 50 | 400 | 1.200 | 1.000 | 1.000 |"
    assert lines[4] == "| vanilla-again (concurrency 8) | 100 | 50 | 400 | 1.000 | 1.000 | 1.000 |"
    assert len(lines) == 5


def test_cpu_figures_are_the_differences_in_ms_per_role():
    before = {"api_server": 1.0, "engine_core": 2.0, "worker": 3.0}
    after = {"api_server": 1.25, "engine_core": 2.5, "worker": 4.0}
    assert serve_paired.cpu_figures(before, after) == {
        "cpu_api": 250.0,
        "cpu_core": 500.0,
        "cpu_worker": 1000.0,
    }


def test_cpu_ratios_leave_out_vanilla_waves_that_read_zero():
    got = {
        ("vanilla", 8): [{"cpu_api": a, "cpu_core": 0.0, "cpu_worker": 10.0} for a in (0.0, 10.0)],
        ("unused", 8): [{"cpu_api": a, "cpu_core": 0.0, "cpu_worker": 10.0} for a in (10.0, 20.0)],
    }
    assert serve_paired.cpu_table(got).splitlines()[3] == (
        "| unused (concurrency 8) | 15 | 0 | 10 | 2.000 | n/a | 1.000 |"
    )
