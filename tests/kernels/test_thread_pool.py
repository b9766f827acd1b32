"""The persistent thread pool: work coverage, barrier ordering, error propagation, pinning,
placement per node, and that an idle pool sleeps. Python callables run on the workers (each
call takes the GIL), so these check behaviour, not speed."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ktd import _native

N_CPUS = len(_native.choose_cpus(_native.read_topology()))


def run_with_timeout(fn, seconds=60.0):
    """Run fn in a thread; fail (instead of hanging the suite) if it does not return."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "thread pool call did not return (deadlock)"
    if "error" in result:
        raise result["error"]
    return result.get("value")


def pools():
    """Pinned pools of every size this machine allows, plus unpinned (oversubscribed) ones."""
    out = [dict(n_threads=n) for n in range(1, N_CPUS + 1)]
    out += [dict(n_threads=n, pin=False) for n in (3, 5, 8)]
    return out


@pytest.mark.parametrize("opts", pools(), ids=lambda o: f"n{o['n_threads']}{'' if o.get('pin', True) else '-unpinned'}")
def test_parallel_for_covers_range_exactly_once(opts):
    pool = _native.ThreadPool(**opts)
    assert pool.size == opts["n_threads"]
    for n in (0, 1, 2, 3, 7, 8, 63, 64, 1000, 1001):
        hits = np.zeros(n, dtype=np.int64)
        chunks = []

        def body(begin, end, tid):
            assert 0 <= begin < end <= n
            hits[begin:end] += 1
            chunks.append((begin, end, tid))

        run_with_timeout(lambda: pool.parallel_for(n, body))
        assert (hits == 1).all(), f"n={n}"
        tids = [c[2] for c in chunks]
        assert len(tids) == len(set(tids)), "a worker got two chunks"
        assert all(0 <= t < pool.size for t in tids)
        # Contiguous chunks in tid order.
        ordered = sorted(chunks, key=lambda c: c[2])
        assert [c[0] for c in ordered] == sorted(c[0] for c in chunks)


@pytest.mark.parametrize("n_threads, pin", [(1, True), (N_CPUS, True), (4, False), (7, False)])
def test_run_calls_every_worker_once(n_threads, pin):
    pool = _native.ThreadPool(n_threads=n_threads, pin=pin)
    seen = []
    run_with_timeout(lambda: pool.run(lambda tid, nth: seen.append((tid, nth))))
    assert sorted(seen) == [(t, n_threads) for t in range(n_threads)]
    # The pool is persistent: the same workers serve many runs.
    for _ in range(50):
        seen.clear()
        pool.run(lambda tid, nth: seen.append(tid))
        assert sorted(seen) == list(range(n_threads))


@pytest.mark.parametrize("n_threads, pin", [(N_CPUS, True), (5, False)])
def test_barrier_orders_phases(n_threads, pin):
    pool = _native.ThreadPool(n_threads=n_threads, pin=pin)
    log = []
    phases = 6

    def body(tid, nth):
        for phase in range(phases):
            log.append((phase, tid))
            pool.barrier(tid)

    for _ in range(3):
        log.clear()
        run_with_timeout(lambda: pool.run(body))
        assert len(log) == phases * n_threads
        phase_seq = [p for p, _ in log]
        assert phase_seq == sorted(phase_seq), "a worker passed a barrier before all arrived"
        for phase in range(phases):
            assert sorted(t for p, t in log if p == phase) == list(range(n_threads))


def test_exception_in_a_worker_propagates_and_pool_survives():
    pool = _native.ThreadPool(n_threads=4, pin=False)

    def body(tid, nth):
        if tid == 2:
            raise ValueError("boom from worker 2")

    with pytest.raises(ValueError, match="boom from worker 2"):
        run_with_timeout(lambda: pool.run(body))
    seen = []
    run_with_timeout(lambda: pool.run(lambda tid, nth: seen.append(tid)))
    assert sorted(seen) == [0, 1, 2, 3]


@pytest.mark.parametrize("thrower", [0, 3])
def test_exception_releases_workers_waiting_in_barrier(thrower):
    pool = _native.ThreadPool(n_threads=4, pin=False)

    def body(tid, nth):
        pool.barrier(tid)
        if tid == thrower:
            raise KeyError("failed between barriers")
        pool.barrier(tid)  # the others wait here for a worker that never comes

    with pytest.raises(KeyError, match="failed between barriers"):
        run_with_timeout(lambda: pool.run(body))
    log = []

    def ok(tid, nth):
        log.append(tid)
        pool.barrier(tid)

    run_with_timeout(lambda: pool.run(ok))
    assert sorted(log) == [0, 1, 2, 3]


def test_parallel_for_exception_propagates():
    pool = _native.ThreadPool(n_threads=3, pin=False)

    def body(begin, end, tid):
        if begin == 0:
            raise RuntimeError("chunk 0 failed")

    with pytest.raises(RuntimeError, match="chunk 0 failed"):
        run_with_timeout(lambda: pool.parallel_for(30, body))


def test_workers_are_pinned_to_distinct_allowed_cpus():
    pool = _native.ThreadPool()
    topo = _native.read_topology()
    assert pool.size == N_CPUS
    slots = [pool.cpu_slot(t) for t in range(pool.size)]
    assert [(c, pool.node_of(t)) for t, c in enumerate(slots)] == _native.choose_cpus(topo)
    assert len(set(slots)) == pool.size
    for tid in range(1, pool.size):
        # The kernel's view of each worker thread's mask, by its thread id.
        assert os.sched_getaffinity(pool.thread_id(tid)) == {pool.cpu_of(tid)}
        assert pool.node_of(tid) == topo.node_of_cpu(pool.cpu_of(tid))
    # The caller is tid 0 and is left unpinned.
    before = os.sched_getaffinity(0)
    pool.run(lambda tid, nth: None)
    assert os.sched_getaffinity(0) == before
    assert pool.cpu_of(0) == -1 and pool.thread_id(0) == -1


def test_pin_caller_pins_the_calling_thread():
    pool = _native.ThreadPool()
    got = {}

    def forward_thread():
        pool.pin_caller()
        got["mask"] = os.sched_getaffinity(0)

    t = threading.Thread(target=forward_thread)
    t.start()
    t.join()
    assert got["mask"] == {pool.cpu_slot(0)}
    assert pool.cpu_of(0) == pool.cpu_slot(0)


def test_unpinned_pool_reports_no_cpus():
    pool = _native.ThreadPool(n_threads=3, pin=False)
    assert [pool.cpu_of(t) for t in range(3)] == [-1, -1, -1]
    for tid in (1, 2):
        assert os.sched_getaffinity(pool.thread_id(tid)) == os.sched_getaffinity(0)


def test_nodes_and_per_node_parallel_for():
    pool = _native.ThreadPool(n_threads=4, pin=False)
    topo = _native.read_topology()
    assert pool.nodes() == sorted({n for _, n in _native.choose_cpus(topo)})
    total = []
    for node in pool.nodes():
        tids = pool.workers_of_node(node)
        assert tids == list(range(tids[0], tids[0] + len(tids)))
        hits = np.zeros(101, dtype=np.int64)
        used = set()

        def body(begin, end, tid):
            hits[begin:end] += 1
            used.add(tid)

        run_with_timeout(lambda: pool.parallel_for_node(node, 101, body))
        assert (hits == 1).all()
        assert used <= set(tids)
        total += tids
    assert sorted(total) == list(range(pool.size))
    with pytest.raises(ValueError, match="no worker on NUMA node 7"):
        pool.parallel_for_node(7, 10, lambda b, e, t: None)


@pytest.mark.parametrize("opts", pools(), ids=lambda o: f"n{o['n_threads']}{'' if o.get('pin', True) else '-unpinned'}")
def test_for_each_item_runs_every_item_exactly_once(opts):
    pool = _native.ThreadPool(**opts)
    # 0 items, fewer items than workers, many more.
    for n in (0, 1, 2, 3, 7, 64, 1001):
        hits = np.zeros(n, dtype=np.int64)
        tids = set()

        def body(item, tid):
            assert 0 <= item < n, item
            hits[item] += 1
            tids.add(tid)

        run_with_timeout(lambda: pool.for_each_item(n, body))
        assert (hits == 1).all(), f"n={n}: {hits}"
        assert tids <= set(range(pool.size))
        if n == 0:
            assert not tids


def test_for_each_item_exception_propagates_and_pool_survives():
    pool = _native.ThreadPool(n_threads=4, pin=False)

    def body(item, tid):
        if item == 5:
            raise ValueError("item 5 failed")

    with pytest.raises(ValueError, match="item 5 failed"):
        run_with_timeout(lambda: pool.for_each_item(40, body))
    hits = np.zeros(40, dtype=np.int64)
    run_with_timeout(lambda: pool.for_each_item(40, lambda item, tid: hits.__setitem__(item, hits[item] + 1)))
    assert (hits == 1).all()


@pytest.mark.parametrize("n_nodes, n_threads", [(1, 3), (2, 2), (2, 5), (4, 8), (4, 6)])
def test_for_each_item_node_keeps_items_on_their_node(fake_numa_machine, n_nodes, n_threads):
    pool = _native.ThreadPool(n_threads=n_threads, pin=False, **fake_numa_machine(n_nodes))
    assert pool.nodes() == list(range(n_nodes))
    for tid in range(pool.size):
        assert pool.nodes()[pool.node_index(tid)] == pool.node_of(tid)
    # Uneven ranges, one of them empty when there are several nodes; fewer items than workers.
    for sizes in ([1] * n_nodes, [0] + [9] * (n_nodes - 1), [37 + 13 * i for i in range(n_nodes)]):
        first = [0]
        for size in sizes:
            first.append(first[-1] + size)
        hits = np.zeros(first[-1], dtype=np.int64)
        ran_on = {}

        def body(item, tid):
            hits[item] += 1
            ran_on[item] = pool.node_of(tid)

        run_with_timeout(lambda: pool.for_each_item_node(first, body))
        assert (hits == 1).all(), sizes
        for i in range(n_nodes):
            for item in range(first[i], first[i + 1]):
                assert ran_on[item] == pool.nodes()[i], f"item {item} of node {i} ran on node {ran_on[item]}"
    with pytest.raises(ValueError, match="range bounds"):
        pool.for_each_item_node([0] * (n_nodes + 2), lambda item, tid: None)
    if n_nodes > 1:
        with pytest.raises(ValueError, match="ends before it starts"):
            pool.for_each_item_node([0, 5] + [2] * (n_nodes - 1), lambda item, tid: None)


def test_work_lists_between_barriers_of_one_run(fake_numa_machine):
    # Two phases in one region: phase 2's list is reset by one worker before the barrier, and
    # every phase-1 item is done before any worker passes it.
    pool = _native.ThreadPool(n_threads=5, pin=False, **fake_numa_machine(2))
    up, down = _native.WorkList(), _native.WorkList()
    n_up, first_down = 23, [0, 4, 31]
    hits_up = np.zeros(n_up, dtype=np.int64)
    hits_down = np.zeros(first_down[-1], dtype=np.int64)
    seen_before_down = []

    def body(tid, nth):
        while (item := up.claim(0)) is not None:
            hits_up[item] += 1
        if tid == 0:
            down.reset_slices(first_down)
        pool.barrier(tid)
        seen_before_down.append(int(hits_up.sum()))
        sl = pool.node_index(tid)
        while (item := down.claim(sl)) is not None:
            assert first_down[sl] <= item < first_down[sl + 1]
            hits_down[item] += 1

    for _ in range(3):
        hits_up[:] = 0
        hits_down[:] = 0
        seen_before_down.clear()
        up.reset(n_up)
        run_with_timeout(lambda: pool.run(body))
        assert (hits_up == 1).all() and (hits_down == 1).all()
        assert seen_before_down == [n_up] * pool.size
        assert up.claim(0) is None  # an exhausted list stays exhausted until reset


def test_work_list_rejects_bad_ranges():
    wl = _native.WorkList()
    with pytest.raises(ValueError, match="ends before it starts"):
        wl.reset_slices([0, 3, 2])
    wl.reset_slices([2, 2, 4])
    assert wl.n_slices == 2
    assert wl.claim(0) is None
    assert [wl.claim(1), wl.claim(1), wl.claim(1)] == [2, 3, None]
    with pytest.raises(IndexError):
        wl.claim(2)


def test_range_list_owner_takes_its_front_then_steals_from_the_backs():
    rl = _native.RangeList()
    rl.reset(10, 3)  # ranges [0, 3), [3, 6), [6, 10), as parallel_for cuts them
    assert rl.n_owners == 3
    assert rl.claim(1) == 3  # an owner starts at the front of its own range
    # Owner 0 runs through its range, then takes the others' items from their backs: the next
    # owner's first (down to what owner 1 already took), then owner 2's.
    assert [rl.claim(0) for _ in range(10)] == [0, 1, 2, 5, 4, 9, 8, 7, 6, None]
    assert rl.claim(1) is None and rl.claim(2) is None  # stays empty until the next reset
    rl.reset(2, 4)  # fewer items than owners: empty ranges steal at once
    assert sorted([rl.claim(0), rl.claim(0)]) == [0, 1] and rl.claim(3) is None
    with pytest.raises(IndexError):
        rl.claim(4)
    with pytest.raises(ValueError, match="owners"):
        rl.reset(5, 0)
    with pytest.raises(ValueError, match="2\\^32"):
        rl.reset(1 << 32, 2)


@pytest.mark.parametrize("n", [0, 3, 1000])
def test_range_list_every_item_once_across_workers(fake_numa_machine, n):
    # Real concurrency (the claims run without the GIL): worker 0's items sleep, so the others
    # finish their own ranges and race for its back while it takes its front.
    pool = _native.ThreadPool(n_threads=4, pin=False, **fake_numa_machine(2))
    hits, by = run_with_timeout(lambda: _native.range_list_exercise(pool, n, slow_tid=0, rounds=20))
    assert hits == [20] * n
    assert all(0 <= t < pool.size for t in by)
    # Within its own range a worker takes only the front, the thieves only the back: what worker
    # 0 ran of its range is a prefix of it (empty when the thieves were quicker).
    own0 = [i for i, t in enumerate(by[: n // pool.size]) if t == 0]
    assert own0 == list(range(len(own0)))


def test_bad_options():
    with pytest.raises(ValueError, match="exceeds"):
        _native.ThreadPool(n_threads=N_CPUS + 1)
    with pytest.raises(ValueError, match="node 63 is not online"):
        _native.ThreadPool(nodes=[63])
    with pytest.raises(ValueError, match="n_threads"):
        _native.ThreadPool(n_threads=-1)
    pool = _native.ThreadPool(n_threads=1)
    with pytest.raises(IndexError):
        pool.node_of(1)


def test_process_affinity_limits_the_pool():
    # taskset-like restriction in a child process: the pool must only use the allowed CPU.
    cpu = max(os.sched_getaffinity(0))
    code = (
        "import os; os.sched_setaffinity(0, {%d}); from ktd import _native; "
        "p = _native.ThreadPool(); print(p.size, p.cpu_slot(0))" % cpu
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["1", str(cpu)]


def test_idle_pool_uses_no_cpu():
    pool = _native.ThreadPool()
    pool.run(lambda tid, nth: None)
    time.sleep(0.05)  # past the bounded spin: every worker is asleep on its futex now
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    used = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    assert used < 0.05, f"idle pool of {pool.size} used {used:.3f} s CPU in 1 s"


def test_spin_us_decides_whether_idle_workers_sleep_between_regions():
    """set_spin_us (the hybrid forward's gpu.pool_spin_us): with no spin a worker waiting for the
    next region goes to sleep on the futex (worker_sleeps counts those waits), with a spin longer
    than the gap between regions it never does. Counts, not times: a 10 s spin against 30 ms gaps."""
    if N_CPUS < 2:
        pytest.skip("needs 2 usable CPUs (a worker besides the caller, not oversubscribed)")
    pool = _native.ThreadPool(n_threads=2, pin=False)
    assert pool.spin_us == 50  # ThreadPoolOptions' default
    noop = lambda tid, nth: None  # noqa: E731
    pool.spin_us = 0
    pool.run(noop)
    pool.set_stats(True)
    for _ in range(3):
        time.sleep(0.03)
        pool.run(noop)
    assert 1 <= pool.stats()["worker_sleeps"] <= 3
    pool.spin_us = 10_000_000
    pool.run(noop)  # the worker was asleep: woken once more, spinning from now on
    pool.reset_stats()
    for _ in range(3):
        time.sleep(0.03)
        pool.run(noop)
    assert pool.stats()["worker_sleeps"] == 0
    assert pool.spin_us == 10_000_000
    with pytest.raises(ValueError, match="spin_us must be >= 0"):
        pool.spin_us = -1
    del pool  # shutdown wakes the spinning worker
    over = _native.ThreadPool(n_threads=N_CPUS + 1, pin=False)
    assert over.spin_us == 0  # oversubscribed: a spinner would burn the time of the worker it waits for
    over.spin_us = 1000
    assert over.spin_us == 0


def test_handoff_latency_is_measurable():
    # Reported, never asserted against a time (shared, noisy machines); only sanity of the probe.
    pool = _native.ThreadPool()
    lat = pool.handoff_latency(1000)
    assert lat["run_ns"] > 0 and lat["barrier_ns"] >= 0
    with pytest.raises(ValueError):
        pool.handoff_latency(0)


# --- region timing (set_stats; ktd.bench.decode --breakdown reads it) ---------------------------


@pytest.mark.parametrize("n_threads", [1, 3])
def test_stats_count_regions_and_barriers_and_fit_inside_the_wall_time(n_threads):
    """The counts are exact (the test makes them), the times are bounded by the caller's own
    perf_counter around the regions, and the workers' busy time by the region time."""
    pool = _native.ThreadPool(n_threads=n_threads, pin=False)
    zero = pool.stats()
    assert zero["runs"] == 0 and zero["run_ns"] == 0 and zero["busy_ns"] == [0] * n_threads
    pool.run(lambda tid, nth: None)  # stats off: nothing is counted
    assert pool.stats() == zero and not pool.stats_enabled

    pool.set_stats(True)
    seen = []

    def fn(tid, nth):
        for _ in range(2):
            pool.barrier(tid)
        if tid == nth - 1:
            time.sleep(0.002)  # the last worker finishes late: the caller waits for it
        seen.append(tid)

    t0 = time.perf_counter_ns()
    for _ in range(4):
        pool.run(fn)
    pool.for_each_item(5, lambda item, tid: None)
    pool.for_each_item(0, lambda item, tid: None)  # no items: no region
    wall = time.perf_counter_ns() - t0
    s = pool.stats()
    assert len(seen) == 4 * n_threads
    assert s["runs"] == 5
    assert s["barriers"] == 8  # tid 0's calls, also on a pool of one
    assert 0 < s["run_ns"] <= wall
    assert s["join_wait_ns"] <= s["run_ns"] and s["barrier_wait_ns"] <= s["run_ns"]
    assert len(s["busy_ns"]) == len(s["start_ns"]) == n_threads
    assert all(0 < b <= s["run_ns"] for b in s["busy_ns"])
    assert s["start_ns"][0] == 0
    if n_threads > 1:
        # tid 0 returned before the late worker in each of the 4 runs, and waited >= 2 ms for it
        assert s["join_wait_ns"] >= 4 * 2_000_000
        assert s["busy_ns"][-1] >= 4 * 2_000_000
    pool.reset_stats()
    assert pool.stats()["runs"] == 0 and pool.stats()["busy_ns"] == [0] * n_threads
    pool.set_stats(False)
    pool.run(lambda tid, nth: None)
    assert pool.stats()["runs"] == 0


def test_stats_survive_an_exception_in_a_region():
    pool = _native.ThreadPool(n_threads=3, pin=False)
    pool.set_stats(True)

    def fn(tid, nth):
        if tid == 1:
            raise ValueError("boom")
        pool.barrier(tid)

    with pytest.raises(ValueError, match="boom"):
        pool.run(fn)
    s = pool.stats()
    assert s["runs"] == 1 and s["barriers"] == 1
    pool.run(lambda tid, nth: None)
    assert pool.stats()["runs"] == 2
