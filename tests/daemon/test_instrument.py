"""ktd.server.instrument: the status document, the metrics text, the STATUS= line and the /proc parsers."""

from __future__ import annotations

from collections import Counter

import fake_engine
from ktd.server import instrument
from ktd.server import protocol
from ktd.server.scheduler import Scheduler

MEMINFO = """MemTotal:       16318228 kB
MemFree:         1015932 kB
MemAvailable:    9839240 kB
AnonHugePages:     81920 kB
HugePages_Total:      16
HugePages_Free:       16
Hugepagesize:       2048 kB
Hugetlb:           32768 kB
""".splitlines(keepends=True)

SMAPS = """55d4c0e1e000-7ffd8a5f9000 ---p 00000000 00:00 0                          [rollup]
Rss:              420148 kB
Pss:              410000 kB
AnonHugePages:      2048 kB
FilePmdMapped:         0 kB
Private_Hugetlb:       0 kB
Shared_Hugetlb:        0 kB
""".splitlines(keepends=True)

FACTS = instrument.ServerFacts(state="serving", socket="/run/ktd/ktd.sock", activated=True,
                               connections=3, reloads=2, uptime_s=12.34567)
STATS = {"slots_total": 4, "slots_in_use": 1, "queued": 2, "max_queue": 8, "steps": 17,
         "tokens_per_s": 12.25, "idle": False,
         "prefix_cache": {"slots": 4, "entries": 2, "tokens_held": 300, "bytes_held": 3686400,
                          "max_bytes": 1 << 30, "hits": 7, "misses": 3, "evictions": 1, "cached_tokens": 2100}}


def test_proc_parsers_keep_the_shown_fields_in_bytes_and_counts():
    assert instrument.parse_meminfo(MEMINFO) == {
        "MemTotal": 16318228 * 1024, "MemAvailable": 9839240 * 1024, "AnonHugePages": 81920 * 1024,
        "HugePages_Total": 16, "HugePages_Free": 16, "Hugepagesize": 2048 * 1024}
    assert instrument.parse_smaps_rollup(SMAPS) == {
        "Rss": 420148 * 1024, "AnonHugePages": 2048 * 1024, "FilePmdMapped": 0,
        "Private_Hugetlb": 0, "Shared_Hugetlb": 0}
    assert instrument.parse_meminfo([]) == {} and instrument.parse_smaps_rollup(["garbage\n"]) == {}


def test_the_proc_readers_read_this_process():
    assert instrument.read_smaps_rollup().get("Rss", 1) > 0
    assert instrument.read_meminfo().get("MemTotal", 1) > 0


def test_status_line():
    assert instrument.status_line(FACTS, "m.gguf", STATS) == (
        "serving m.gguf on /run/ktd/ktd.sock (socket-activated): 1/4 slots, 2 queued, 12.2 tok/s, reloads=2")
    plain = instrument.ServerFacts("reloading", "/tmp/s", False, 0, 0, 0.0)
    assert instrument.status_line(plain, "m", STATS) == "reloading m on /tmp/s: 1/4 slots, 2 queued, 12.2 tok/s"
    # model.weights_map: auto after a miss: the switch while it is pending or when it failed, not once done
    for state, note in (("building", ", weights gguf (building arena)"), ("ready", ", weights gguf (ready arena)"),
                        ("failed", ", weights gguf (switch to arena failed)"), ("done", ""), ("none", "")):
        info = {"memory": {"weights_map_switch": {"state": state, "from": "gguf", "to": "arena"}}}
        assert instrument.status_line(plain, "m", STATS, info) == \
            "reloading m on /tmp/s: 1/4 slots, 2 queued, 12.2 tok/s" + note


def test_status_document():
    info = {"name": "m", "isa": "avx2", "threads": 8, "numa": {"nodes": []},
            "memory": {"hugepages": {"kind": "thp"}, "weights_map": "gguf", "file_mapped_bytes": 5}}
    doc = instrument.status_document(FACTS, pid=42, info=info, stats=STATS, n_ctx=4096,
                                     prefill_tokens_per_step=256, limits=protocol.Limits(max_tokens=7),
                                     process_memory={"Rss": 1}, system_memory={"MemTotal": 2}, affinity=16)
    assert doc["server"]["pid"] == 42 and doc["server"]["uptime_s"] == 12.346
    assert doc["server"]["socket_activated"] and doc["server"]["connections"] == 3
    assert doc["scheduler"] == {**STATS, "n_ctx": 4096, "prefill_tokens_per_step": 256}
    assert doc["memory"] == {"process": {"Rss": 1}, "system": {"MemTotal": 2}, "hugepages": {"kind": "thp"},
                             "weights_map": "gguf", "file_mapped_bytes": 5}
    assert doc["cpu"] == {"affinity": 16, "isa": "avx2", "threads": 8, "numa": {"nodes": []}}
    assert doc["limits"]["max_tokens"] == 7 and doc["model"] is info


def test_metrics_text_is_prometheus_exposition():
    text = instrument.metrics_text(
        up=True, requests=Counter({"requests_generate": 5, "requests_hello": 1, "errors_busy": 2,
                                   "rejected_unauthorized": 1}),
        scheduler=Counter({"finished_stop": 3, "finished_length": 1, "generated_tokens": 40}),
        stats=STATS, seconds={"step": 1.5, "forward": 1.25, "sample": 0.125}, connections=3)
    lines = text.splitlines()
    assert text.endswith("\n")
    assert lines[:3] == ["# HELP ktd_up 1 while serving", "# TYPE ktd_up gauge", "ktd_up 1"]
    for sample in ('ktd_requests_total{method="generate"} 5', 'ktd_requests_total{method="hello"} 1',
                   'ktd_errors_total{code="busy"} 2', 'ktd_rejected_connections_total{reason="unauthorized"} 1',
                   'ktd_generate_finished_total{reason="length"} 1', 'ktd_generate_finished_total{reason="stop"} 3',
                   "ktd_generated_tokens_total 40", "ktd_prompt_tokens_total 0", "ktd_steps_total 17",
                   "ktd_step_seconds_total 1.5", "ktd_forward_seconds_total 1.25", "ktd_sample_seconds_total 0.125",
                   "ktd_tokens_per_second 12.25", "ktd_slots_in_use 1", "ktd_slots_total 4",
                   "ktd_queue_length 2", "ktd_connections 3", "ktd_prefix_cache_hits_total 7",
                   "ktd_prefix_cache_misses_total 3", "ktd_prefix_cache_evictions_total 1",
                   "ktd_prefix_cache_cached_tokens_total 2100", "ktd_prefix_cache_bytes 3686400",
                   "ktd_prefix_cache_entries 2"):
        assert sample in lines, sample
    names = [line.split()[2] for line in lines if line.startswith("# TYPE")]
    assert len(names) == len(set(names)) == 22
    assert "ktd_up 0" in instrument.metrics_text(up=False, requests={}, scheduler={}, stats=STATS,
                                                 seconds={"step": 0, "forward": 0, "sample": 0},
                                                 connections=0).splitlines()


def test_instrument_reads_the_engine_the_scheduler_and_its_readers():
    eng = fake_engine.FakeEngine(n_ctx=128, n_seq_max=2)
    sched = Scheduler(eng, prefill_tokens_per_step=32, max_queue=4)  # not started: stats only
    counters = Counter({"requests_status": 1})
    inst = instrument.Instrument(eng, sched, counters, read_process_memory=lambda: {"Rss": 5},
                                 read_system_memory=lambda: {"MemTotal": 6}, affinity=lambda: 3)
    doc = inst.status(FACTS, protocol.Limits())
    assert doc["memory"]["process"] == {"Rss": 5} and doc["memory"]["system"] == {"MemTotal": 6}
    assert doc["cpu"]["affinity"] == 3 and doc["model"]["name"] == "fake"
    assert doc["scheduler"]["slots_total"] == 2 and doc["scheduler"]["n_ctx"] == 128
    assert doc["scheduler"]["prefill_tokens_per_step"] == 32
    assert inst.status_line(FACTS).startswith("serving fake on /run/ktd/ktd.sock (socket-activated): 0/2 slots")
    counters["requests_metrics"] += 1  # shared with the connections: read at each report
    assert 'ktd_requests_total{method="metrics"} 1' in inst.metrics(up=True, connections=1)
