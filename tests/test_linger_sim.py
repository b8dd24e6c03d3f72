"""Invariants of bench/linger_sim.py (issue 10 part 4's policy simulator). Pure Python, no cluster.

Expected values are computed here from the seed's own numbers (Table 9, eq. 3.4/3.5), not by the
simulator's code."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import linger_sim as sim  # noqa: E402

POLICIES = ["LL", "LF", "IE", "PM", "IE-restart"]


@pytest.fixture(scope="module")
def loaded():
    return sim.Cluster(seed=3, nodes=64, windows=5400)


def test_owners_always_idle_every_policy_same_job_time():
    # Table 9's 0% row: run mean 0.000427 s, idle mean 0.030033 s; 100 µs lost per owner burst.
    run_mean, idle_mean, cs = 0.000427, 0.030033, 100e-6
    share = (idle_mean - cs) / (idle_mean + run_mean)
    expected = 600 / share  # ≈ 610.4 s: 600 s of work + the owner's bursts + context switches
    windows = 1000
    traces = [[(0, True)] * windows for _ in range(16)]
    c = sim.Cluster(seed=5, nodes=16, traces=traces)
    times = {}
    for p in POLICIES:
        r = sim.simulate(c, p, 16, 600.0)
        assert r["done"] == 16, p
        assert r["migrations"] == 0 and r["restarts"] == 0, p
        times[p] = r["avg_job_time_s"]
        assert abs(r["avg_job_time_s"] - expected) / expected < 0.015, (p, r["avg_job_time_s"], expected)
    assert len(set(round(v, 6) for v in times.values())) == 1, times


@pytest.mark.parametrize("policy", POLICIES)
def test_conservation_all_jobs_get_exactly_their_work(loaded, policy):
    r = sim.simulate(loaded, policy, 128, 600.0)
    assert r["done"] == 128
    assert all(abs(c - 600.0) < 1e-6 for c in r["job_cpu_s"]), policy
    assert abs(r["guest_cpu_s"] - 128 * 600.0) < 1e-3, policy
    if policy == "IE-restart":
        assert r["restarts"] > 0 and r["wasted_cpu_s"] > 0
    else:
        assert r["wasted_cpu_s"] == 0


def test_lf_never_migrates(loaded):
    r = sim.simulate(loaded, "LF", 128, 600.0)
    assert r["migrations"] == 0 and r["restarts"] == 0
    assert all(len(n) == 1 for n in r["job_nodes"])
    assert r["linger_cpu_s"] > 0  # under load, LF does run on owners' busy machines


def test_only_lingering_policies_run_on_busy_nodes(loaded):
    for p in ("IE", "PM", "IE-restart"):
        assert sim.simulate(loaded, p, 128, 600.0)["linger_cpu_s"] == 0, p
    for p in ("LL", "LF"):
        assert sim.simulate(loaded, p, 128, 600.0)["linger_cpu_s"] > 0, p


def test_eq_3_4_and_3_5():
    # 8 MB at 3 Mbit/s plus 0.5 s suspend and 0.5 s resume
    tm = 0.5 + 8 * 1048576 * 8 / 3e6 + 0.5
    assert abs(sim.t_migr() - tm) < 1e-9
    assert abs(sim.t_lingr(0.5, 0.0, tm) - 2 * tm) < 1e-9  # (1-0)/(0.5-0) = 2
    assert abs(sim.t_lingr(0.9, 0.1, 10.0) - 11.25) < 1e-9  # 0.9/0.8 * 10
    assert sim.t_lingr(0.1, 0.1, tm) == float("inf")


def test_burst_model_matches_table9_mean_and_variance():
    import random
    import statistics
    rng = random.Random(11)
    for mean, var in [(0.066808, 0.038747), (0.009279, 0.000110), (0.005590, 0.000032)]:  # Table 9 rows
        f = sim.burst_sampler(mean, var)
        xs = [f(rng) for _ in range(60000)]
        assert abs(statistics.mean(xs) - mean) / mean < 0.03
        assert abs(statistics.pvariance(xs) - var) / var < 0.12
