"""ktd.ops.config: typed validation, key/line in messages, env overrides, the shipped ktd.yaml, CLI."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from ktd.ops import config
from paths import ROOT
ROOT = str(ROOT)
SHIPPED = os.path.join(ROOT, "config", "ktd.yaml")


def test_defaults_without_file():
    c = config.load(None, environ={})
    assert c == config.Config()
    assert c.server.socket_mode == 0o660 and c.model.hugepages == "auto"


def test_shipped_file_documents_every_key_with_its_default():
    text = open(SHIPPED).read()
    assert config.load(SHIPPED, environ={}) == config.Config()  # everything commented out
    # Uncomment every "  # key: value" line: the result must parse to the defaults (except the
    # example model path), i.e. each documented default is the real default.
    uncommented = re.sub(r"^  # (\w+): ", r"  \1: ", text, flags=re.M)
    c = config.load(text=uncommented, environ={})
    assert dataclasses.replace(c, model=dataclasses.replace(c.model, path=None)) == config.Config()
    for section, cls in config.SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert re.search(rf"^  # {f.name}: ", text, re.M), f"{section}.{f.name} not documented"


@pytest.mark.parametrize("text, fragment", [
    ("model:\n  n_ctx: lots\n", "<config>:2: model.n_ctx: expected an integer"),
    ("model:\n  n_ctx: 8\n", "model.n_ctx: 8 is below the minimum 16"),
    ("server:\n  sockett: /x\n", "<config>:2: unknown key server.sockett"),
    ("modle: {}\n", "<config>:1: unknown section 'modle'"),
    ("model:\n  hugepages: yes\n", "model.hugepages: expected one of auto, hugetlb, thp, off"),
    ("server:\n  socket_mode: 0999\n", "server.socket_mode: expected octal permission bits"),
    ("server:\n  allowed_uids: 0\n", "server.allowed_uids: expected a list"),
    ("model:\n  smt: 1\n", "model.smt: expected true or false"),
    ("model: [1, 2]\n", "<config>:1: model: expected a mapping"),
    ("numa:\n  experts: mirror\n", "<config>:2: numa.experts: expected one of shard, off"),
    ("numa:\n  dense: mirror\n", "<config>:2: numa.dense: expected one of interleave, replicate"),
    ("numa:\n  nodes: [0]\n", "<config>:2: unknown key numa.nodes"),
    ("model:\n  hugepage_size: 4K\n", "model.hugepage_size: expected one of 2M, 1G"),
    ("model:\n  n_ctx: 1\n  n_ctx: 2\n", "<config>:3: model.n_ctx: duplicate key"),
    ("model:\n  n_ctx: [\n", "invalid YAML"),
    ("- 1\n", "top level: expected a mapping"),
])
def test_errors_name_the_key_and_line(text, fragment):
    with pytest.raises(config.ConfigError) as e:
        config.load(text=text, environ={})
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_values_and_octal_mode():
    c = config.load(text="server:\n  socket_mode: 0600\n  allowed_gids: [ktd, 1000]\n"
                         "model:\n  numa_nodes: [0, 1]\n  n_ctx: 8192\n", environ={})
    assert c.server.socket_mode == 0o600
    assert c.server.allowed_gids == ("ktd", 1000)
    assert c.model.numa_nodes == (0, 1) and c.model.n_ctx == 8192
    c = config.load(text='server:\n  socket_mode: "0640"\n', environ={})
    assert c.server.socket_mode == 0o640


def test_environment_overrides_win_and_are_validated():
    env = {"KTD_SERVER__SOCKET": "/tmp/x.sock", "KTD_MODEL__N_CTX": "8192",
           "KTD_SERVER__ALLOWED_UIDS": "[0, 1000]", "PATH": "/bin"}
    c = config.load(text="model:\n  n_ctx: 1024\n", environ=env)
    assert c.server.socket == "/tmp/x.sock" and c.model.n_ctx == 8192
    assert c.server.allowed_uids == (0, 1000)
    with pytest.raises(config.ConfigError, match="environment KTD_MODEL__N_CTX: model.n_ctx: expected an integer"):
        config.load(None, environ={"KTD_MODEL__N_CTX": "big"})
    with pytest.raises(config.ConfigError, match="unknown key model.nctx"):
        config.load(None, environ={"KTD_MODEL__NCTX": "1"})


def test_live_changes_and_apply_live():
    old = config.Config()
    new = config.load(text="model:\n  n_ctx: 8192\nlogging:\n  level: debug\n", environ={})
    live, restart = config.live_changes(old, new)
    assert live == ["logging.level"] and restart == ["model.n_ctx"]
    merged = config.apply_live(old, new)
    assert merged.logging.level == "debug" and merged.model.n_ctx == 4096


def _ktd(*args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("KTD_")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "ktd", *args], capture_output=True, text=True, env=e)


def test_cli_check_and_explain(tmp_path):
    r = _ktd("config", "check", SHIPPED)
    assert r.returncode == 0 and "socket: /run/ktd/ktd.sock" in r.stdout and "socket_mode: 0660" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  max_queue: -1\n")
    r = _ktd("config", "check", str(bad))
    assert r.returncode == 1
    assert r.stderr.strip() == f"ktd: error: {bad}:2: server.max_queue: -1 is below the minimum 0"
    assert "Traceback" not in r.stderr
    r = _ktd("config", "check", str(tmp_path / "missing.yaml"))
    assert r.returncode == 1 and "cannot read" in r.stderr
    r = _ktd("config", "explain")
    assert r.returncode == 0
    for section, cls in config.SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"{section}.{f.name} = " in r.stdout


def test_serve_without_engine_fails_with_one_line(tmp_path):
    import importlib.util

    if importlib.util.find_spec("ktd.server.engine") is not None:
        pytest.skip("this build has an engine (ktd.server.engine exists)")
    r = _ktd("serve", "--socket", str(tmp_path / "s.sock"))
    assert r.returncode == 1
    assert r.stderr.strip() == "ktd: error: model execution is not available in this build yet"


def test_numa_and_memory_keys_reach_the_engine_options():
    from ktd.server.engine import placement_options

    c = config.load(text="model:\n  numa_nodes: [1]\n  smt: true\n  hugepages: off\n  hugepage_size: 1G\n"
                         "  mlock: true\n  weights_cache: /srv/ktd-cache\n  weights_map: arena\n"
                         "numa:\n  experts: off\n",
                    environ={"KTD_NUMA__DENSE": "replicate"})
    assert placement_options(c) == {"nodes": [1], "smt": True, "hugepages": "off", "hugetlb_page_size": 1 << 30,
                                    "mlock": True, "numa_experts": "off", "numa_dense": "replicate",
                                    "weights_cache": "/srv/ktd-cache", "cache_map": True,
                                    "weights_map": "arena"}
    assert placement_options(config.Config())["numa_experts"] == "shard"
    # Unquoted `off` is YAML 1.1 false; quoted it is the string: both mean the choice "off".
    assert config.load(text='numa:\n  experts: "off"\n', environ={}).numa.experts == "off"
    assert config.load(text="model:\n  hugepages: no\n", environ={}).model.hugepages == "off"
    # model.weights_cache: auto (default), off (unquoted: YAML false), or an absolute directory.
    assert config.Config().model.weights_cache == "auto"
    assert config.load(text="model:\n  weights_cache: off\n", environ={}).model.weights_cache == "off"
    with pytest.raises(config.ConfigError, match="model.weights_cache: expected auto, off or an absolute directory"):
        config.load(text="model:\n  weights_cache: relative/dir\n", environ={})
    with pytest.raises(config.ConfigError, match="environment KTD_NUMA__EXPERTS: numa.experts: expected one of"):
        config.load(None, environ={"KTD_NUMA__EXPERTS": "yes"})
