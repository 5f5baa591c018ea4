"""What `make check` runs: the cheapest tests within a budget (tests/conftest.py `quick_tests`)."""

import conftest


def test_the_quick_tests_fit_the_budget_on_a_host_twice_as_slow():
    # costs shaped like a `make test` here: many tests near a second, a few near the 5 s limit
    costs = {f"t{i}": 0.05 + (i % 50) / 50 * 4.9 for i in range(1000)} | {"slow": 30.0}
    chosen = conftest.quick_tests(costs)
    assert sum(costs[n] for n in chosen) <= conftest.QUICK_BUDGET_SECONDS
    assert "slow" not in chosen and all(costs[n] < conftest.QUICK_SECONDS for n in chosen)
    # cheapest first: nothing left out is cheaper than what was chosen
    assert max(costs[n] for n in chosen) <= min(costs[n] for n in costs if n not in chosen)
    # a per-test limit alone would have let in 980 tests: on a host twice as slow, over an hour
    under_limit = [n for n in costs if costs[n] < conftest.QUICK_SECONDS]
    assert 2 * sum(costs[n] for n in under_limit) > 3600 > 2 * conftest.QUICK_BUDGET_SECONDS


def test_ties_are_broken_by_name_so_every_host_picks_the_same_tests():
    costs = {name: 1.0 for name in ("b", "a", "d", "c")}
    assert conftest.quick_tests(costs, budget=2.0) == {"a", "b"}
    assert conftest.quick_tests({}, budget=2.0) == set()
