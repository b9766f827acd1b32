"""The daemon's configuration: one typed source of truth for every key of ``ktd.yaml``.

Each key is a field of a frozen dataclass with its default, unit, effect and whether a SIGHUP
applies it to a running daemon ("live"); ``ktd config explain`` prints exactly this table and
``config/ktd.yaml`` documents the same keys. Loading validates types and ranges and names the
key (with file and line, from the YAML node marks) in the one-line error; unknown keys are
errors, because a misspelt key silently keeping its default is the worse failure.

Environment overrides: ``KTD_<SECTION>__<KEY>=VALUE`` (upper case, double underscore between
section and key), e.g. ``KTD_SERVER__SOCKET=/tmp/ktd.sock`` or ``KTD_MODEL__N_CTX=8192``. The
value is parsed as a YAML scalar/flow value (``KTD_SERVER__ALLOWED_UIDS='[0, 1000]'``) and is
validated like the file's; overrides win over the file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

DEFAULT_PATH = "/etc/ktd/ktd.yaml"
ENV_PREFIX = "KTD_"


class ConfigError(ValueError):
    """Invalid configuration: the message names the key (and file:line when known)."""


def _key(default: Any, help: str, *, kind: str, unit: str = "", live: bool = False,
         choices: tuple[str, ...] = (), min: float | None = None, max: float | None = None):
    meta = {"help": help, "kind": kind, "unit": unit, "live": live, "choices": choices,
            "min": min, "max": max}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = _key(None, "GGUF model file to serve (required by `ktd serve`)", kind="optstr")
    n_ctx: int = _key(4096, "context length per sequence; prompt + generated tokens must fit",
                      kind="int", unit="tokens", min=16, max=1 << 22)
    n_seq_max: int = _key(8, "KV-cache slots = sequences generated concurrently", kind="int",
                          unit="slots", min=1, max=4096)
    threads: int = _key(0, "compute threads; 0 = one per physical core of the selected NUMA nodes",
                        kind="int", unit="threads", min=0, max=4096)
    numa_nodes: tuple[int, ...] = _key((), "NUMA nodes to run on; [] = every node the process may use",
                                       kind="ints", min=0, max=1023)
    smt: bool = _key(False, "also use SMT sibling threads (rarely helps a bandwidth-bound decode)",
                     kind="bool")
    hugepages: str = _key("auto", "prepared-weights memory: auto (reserved huge pages if the pool "
                          "has enough, else THP, else 4 KiB pages; the choice and why is logged at load), "
                          "hugetlb (reserved pool, required), thp, off (4 KiB pages)",
                          kind="choice", choices=("auto", "hugetlb", "thp", "off"))
    hugepage_size: str = _key("2M", "page size of reserved huge pages (hugepages: auto or hugetlb)",
                              kind="choice", choices=("2M", "1G"))
    mlock: bool = _key(False, "lock non-hugetlb weights in RAM (needs LimitMEMLOCK)", kind="bool")
    routing_profile: str = _key("auto", "MoE models: where the routing profile (tokens routed to each "
                                "expert, summed over runs) is kept: auto ($STATE_DIRECTORY, i.e. "
                                "/var/lib/ktd, else ~/.local/state/ktd), off, or an absolute directory",
                                kind="dir_or_off")
    weights_cache: str = _key("auto", "prepared-weights cache (repacked weights kept between starts, checked by "
                              "checksums, rebuilt when the model, ktd or the placement changes): auto "
                              "($CACHE_DIRECTORY, i.e. /var/cache/ktd under systemd, else "
                              "~/.cache/ktd/weights), off, or an absolute directory", kind="dir_or_off")
    weights_cache_map: bool = _key(True, "a cache hit maps the entry into memory (its page-cache pages, 2 MiB "
                                   "where the kernel has them: no copy) rather than reading it into fresh "
                                   "pages; one NUMA node, no mlock, no reserved huge pages (else read)",
                                   kind="bool")
    weights_map: str = _key("auto", "where the forward reads the weight matrices: arena (repacked into "
                            "memory of ktd's own at load, or mapped from the weights cache: the fastest "
                            "decode) or gguf (served in the file's plain layout straight from its page "
                            "cache, as llama.cpp's mmap: nothing prepared, the first start is about a read "
                            "of the file, decode slower where a type repacks; one NUMA node, else arena "
                            "with the reason logged; no weights cache) or auto (arena when the weights "
                            "cache has the entry, else gguf at once while a background process, nice 19 "
                            "and SCHED_IDLE, prepares the entry, which the daemon then switches to when no "
                            "request is in flight, and the next start maps; arena without a cache, on "
                            "several NUMA nodes or with hugepages: hugetlb)",
                            kind="choice", choices=("arena", "gguf", "auto"))


@dataclass(frozen=True)
class NumaConfig:
    experts: str = _key("shard", "routed experts when the threads span several NUMA nodes: shard (each "
                        "node holds a row slice of every expert in its own memory and computes only "
                        "those rows; no copy), off (experts placed like the dense weights)",
                        kind="choice", choices=("shard", "off"))
    dense: str = _key("interleave", "dense (non-expert) weights when the threads span several NUMA "
                      "nodes: interleave (pages spread round-robin over the nodes), replicate (one copy "
                      "per node, each node's threads read their own; memory x nodes)",
                      kind="choice", choices=("interleave", "replicate"))


@dataclass(frozen=True)
class ServerConfig:
    socket: str = _key("/run/ktd/ktd.sock", "Unix socket path bound when not socket-activated",
                       kind="str")
    socket_mode: int = _key(0o660, "permission bits of a self-bound socket (octal)", kind="mode")
    socket_group: str | None = _key("ktd", "group of a self-bound socket; null = the daemon's group",
                                    kind="optstr")
    allowed_uids: tuple[int | str, ...] = _key((0,), "peer uids (or user names) allowed to connect "
                                               "(SO_PEERCRED); the daemon's own uid is always allowed",
                                               kind="ids", live=True)
    allowed_gids: tuple[int | str, ...] = _key(("ktd",), "peer primary gids (or group names) allowed; "
                                               "unknown names are skipped with a warning",
                                               kind="ids", live=True)
    max_connections: int = _key(256, "open client connections; beyond: `busy`", kind="int",
                                unit="connections", min=1, max=1 << 20, live=True)
    max_frame_bytes: int = _key(1 << 20, "largest accepted msgpack message; beyond: `too_large`, "
                                "connection closed", kind="int", unit="bytes", min=4096,
                                max=1 << 30, live=True)
    max_unsent_bytes: int = _key(16 << 20, "answers a connection has not read yet: beyond this the "
                                 "daemon reads no more of its requests; an answer larger than this is "
                                 "`too_large`; a peer twice over (unread generate output) is "
                                 "disconnected", kind="int", unit="bytes", min=64 << 10,
                                 max=1 << 30, live=True)
    max_queue: int = _key(64, "requests waiting for a KV slot; beyond: `busy`", kind="int",
                          unit="requests", min=0, max=1 << 20, live=True)
    idle_timeout_s: float = _key(300.0, "a connection with no request in progress that sends nothing "
                                 "(or only part of a message) for this long is closed; 0 = never",
                                 kind="float", unit="s", min=0, live=True)
    request_deadline_s: float = _key(600.0, "wall-clock limit of one generate request from arrival; "
                                     "0 = none", kind="float", unit="s", min=0, live=True)
    drain_timeout_s: float = _key(30.0, "on SIGTERM, time running requests get to finish before they "
                                  "are cancelled", kind="float", unit="s", min=0, live=True)


@dataclass(frozen=True)
class LimitsConfig:
    max_prompt_tokens: int = _key(32768, "prompt tokens per request (also bounded by model.n_ctx)",
                                  kind="int", unit="tokens", min=1, max=1 << 24, live=True)
    max_tokens: int = _key(4096, "largest max_tokens a request may ask for", kind="int",
                           unit="tokens", min=1, max=1 << 24, live=True)
    max_messages: int = _key(256, "chat messages per request", kind="int", unit="messages",
                             min=1, max=1 << 16, live=True)
    max_nesting: int = _key(16, "nesting depth of a request's msgpack value", kind="int",
                            unit="levels", min=4, max=512, live=True)
    max_stop: int = _key(16, "stop strings per request", kind="int", unit="strings", min=0,
                         max=1024, live=True)
    chat_template_max_chars: int = _key(1 << 22, "characters a chat template may produce (and build "
                                        "in one operation) rendering one request; beyond: "
                                        "`bad_request`", kind="int", unit="characters",
                                        min=4096, max=1 << 30, live=True)
    chat_template_timeout_s: float = _key(2.0, "time a chat template may take rendering one "
                                          "request; beyond: `bad_request`", kind="float", unit="s",
                                          min=0.01, max=600, live=True)


@dataclass(frozen=True)
class SchedulerConfig:
    prefill_tokens_per_step: int = _key(512, "prompt tokens processed per batch step, shared by the "
                                        "prompts being prefilled (decode tokens come on top); larger = "
                                        "faster prefill, longer decode stalls", kind="int",
                                        unit="tokens", min=1, max=1 << 20, live=True)


@dataclass(frozen=True)
class PrefixCacheConfig:
    slots: int = _key(4, "KV slots, beyond model.n_seq_max, that keep finished sequences so that a "
                      "request starting with the same tokens (a chat re-sent with a new turn, a shared "
                      "system prompt) computes only the rest; least recently used first out; 0 = off. "
                      "Each may hold up to model.n_ctx tokens of KV (memory touched as used)",
                      kind="int", unit="slots", min=0, max=4096)
    max_bytes: int = _key(2 << 30, "KV bytes the kept sequences may hold in all (tokens x the model's "
                          "KV bytes per token); beyond: least recently used evicted; 0 = bounded by "
                          "the slots only", kind="int", unit="bytes", min=0, max=1 << 50)
    share: bool = _key(False, "reuse a kept sequence for any client; false = only for its owner (the "
                       "peer's uid on the socket, the API key or Unix peer behind the gateway). Shared, the "
                       "cache tells one user whether another sent a prompt (usage.cached_tokens, the time "
                       "to the first token): share only where every client may see every prompt",
                       kind="bool", live=True)


@dataclass(frozen=True)
class GpuConfig:
    device: int | None = _key(None, "CUDA device index for the hybrid forward (attention, dense layers, shared "
                              "experts, KV cache on the GPU; routed experts on the CPU); null/off = CPU only. "
                              "Without a usable GPU the daemon logs why and runs on the CPU, unless gpu.required",
                              kind="gpu_device")
    backend: str = _key("cuda", "what plays the GPU: cuda, or loopback (the same hybrid data flow with the device "
                        "side run by the CPU: a diagnostic that needs no GPU)", kind="choice",
                        choices=("cuda", "loopback"))
    required: bool = _key(False, "refuse to start when gpu.device is set but the GPU cannot be used (default: "
                          "warn and run on the CPU)", kind="bool")
    vram_budget: int | str = _key("auto", "VRAM the model may take (weights on the GPU + KV cache + a 512 MiB reserve "
                                  "for activations and the CUDA context): auto (the device's memory; loopback: the "
                                  "host's available memory) or a size such as 22G; a plan over it is refused at load "
                                  "with the numbers", kind="size_or_auto")
    layers: int = _key(0, "layers whose dense part (attention, KV cache, dense FFN, shared experts) goes to the GPU, "
                       "from the first; 0 = all (small cards: fewer)", kind="int", unit="layers", min=0, max=1 << 16)
    experts: int | str = _key("none", "routed experts per MoE layer also kept in VRAM: none, a number, or hot (as "
                              "many as the leftover budget holds, the most used of each layer per the routing "
                              "profile)", kind="gpu_experts")
    pool_spin_us: int = _key(2000, "hybrid forward only: how long the CPU pool's idle workers spin waiting for the "
                             "next MoE layer while the GPU runs the dense part between two, before they sleep; "
                             "0 = sleep at once (less CPU power, a wake-up per layer)", kind="int", unit="µs",
                             min=0, max=1_000_000)


@dataclass(frozen=True)
class LoggingConfig:
    level: str = _key("info", "log level", kind="choice", live=True,
                      choices=("debug", "info", "warning", "error"))


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    numa: NumaConfig = field(default_factory=NumaConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


def _where(node: yaml.Node | None, source: str) -> str:
    if node is None:
        return source
    return f"{source}:{node.start_mark.line + 1}"


# One converter per schema kind: (value, the key's schema entry, fail) -> the typed value, where
# fail(expected, value) is the ConfigError naming the key and the value as it was read.
Fail = Callable[[str, Any], ConfigError]


def _to_number(value: Any, meta: Mapping[str, Any], fail: Fail) -> int | float:
    kind = meta["kind"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail("an integer" if kind == "int" else "a number", value)
    if kind == "int" and not isinstance(value, int):
        raise fail("an integer", value)
    return int(value) if kind == "int" else float(value)


def _to_bool(value: Any, meta: Mapping[str, Any], fail: Fail) -> bool:
    if not isinstance(value, bool):
        raise fail("true or false", value)
    return value


def _to_str(value: Any, meta: Mapping[str, Any], fail: Fail) -> str:
    if not isinstance(value, str) or not value:
        raise fail("a non-empty string", value)
    return value


def _to_optstr(value: Any, meta: Mapping[str, Any], fail: Fail) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise fail("a non-empty string or null", value)
    return value


def _to_dir_or_off(value: Any, meta: Mapping[str, Any], fail: Fail) -> str:
    if value is False:  # YAML 1.1 reads an unquoted off as false.
        value = "off"
    if not isinstance(value, str) or not value or (value not in ("auto", "off") and not value.startswith("/")):
        raise fail("auto, off or an absolute directory", value)
    return value


def _is_count(value: Any) -> bool:
    """A non-negative integer (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _to_gpu_device(value: Any, meta: Mapping[str, Any], fail: Fail) -> int | None:
    if value is None or value is False or value == "off":  # YAML 1.1 reads an unquoted off/no as false.
        return None
    if _is_count(value):
        return value
    raise fail("a CUDA device index (0, 1, ...) or off/null", value)


def _to_size_or_auto(value: Any, meta: Mapping[str, Any], fail: Fail) -> str | int:
    if value == "auto" or (_is_count(value) and value > 0):
        return value
    from ktd.model.placement import parse_size
    try:
        out = parse_size(value) if isinstance(value, str) else None
    except ValueError:
        out = None
    if not out:
        raise fail("auto or a positive size such as 22G, 24GiB, 16000M or a byte count", value)
    return out


def _to_gpu_experts(value: Any, meta: Mapping[str, Any], fail: Fail) -> str | int:
    if value is False:  # YAML 1.1: an unquoted `no` is false
        value = "none"
    if value in ("none", "hot") or _is_count(value):
        return value
    raise fail("none, hot or a number of experts per layer", value)


def _to_choice(value: Any, meta: Mapping[str, Any], fail: Fail) -> Any:
    # YAML 1.1 reads an unquoted off/no as false: `hugepages: off` means the choice "off".
    if value is False and "off" in meta["choices"]:
        value = "off"
    if value not in meta["choices"]:
        raise fail("one of " + ", ".join(meta["choices"]), value)
    return value


def _to_mode(value: Any, meta: Mapping[str, Any], fail: Fail) -> int:
    # YAML 1.1 reads 0660 as octal already; a quoted "0660" is accepted too.
    if isinstance(value, str):
        try:
            value = int(value, 8)
        except ValueError:
            raise fail("octal permission bits such as 0660", value) from None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0o777:
        raise fail("octal permission bits such as 0660", value)
    return value


def _to_list(value: Any, meta: Mapping[str, Any], fail: Fail) -> tuple:
    """ints: non-negative integers; ids: those or names (user or group ids)."""
    if not isinstance(value, list):
        raise fail("a list", value)
    for item in value:
        if meta["kind"] == "ints" and not _is_count(item):
            raise fail("a list of non-negative integers", value)
        if meta["kind"] == "ids" and not (_is_count(item) or (isinstance(item, str) and item)):
            raise fail("a list of numeric ids or names", value)
    return tuple(value)


_CONVERTERS: dict[str, Callable[[Any, Mapping[str, Any], Fail], Any]] = {
    "int": _to_number, "float": _to_number, "bool": _to_bool, "str": _to_str, "optstr": _to_optstr,
    "dir_or_off": _to_dir_or_off, "gpu_device": _to_gpu_device, "size_or_auto": _to_size_or_auto,
    "gpu_experts": _to_gpu_experts, "choice": _to_choice, "mode": _to_mode, "ints": _to_list, "ids": _to_list,
}


def _convert(name: str, meta: Mapping[str, Any], value: Any, where: str) -> Any:
    """Check ``value`` against the key's kind and range; return the typed value."""
    def fail(expected: str, got: Any) -> ConfigError:
        return ConfigError(f"{where}: {name}: expected {expected}, got {got!r}")

    out = _CONVERTERS[meta["kind"]](value, meta, fail)  # a KeyError: a kind the schema has and this lacks
    lo, hi = meta["min"], meta["max"]
    for v in out if isinstance(out, tuple) else (out,):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if lo is not None and v < lo:
                raise ConfigError(f"{where}: {name}: {v} is below the minimum {lo}")
            if hi is not None and v > hi:
                raise ConfigError(f"{where}: {name}: {v} is above the maximum {hi}")
    return out


def _construct(node: yaml.Node) -> Any:
    return yaml.SafeLoader("").construct_object(node, deep=True)  # type: ignore[arg-type]


def _mapping_items(node: yaml.Node, what: str, source: str) -> list[tuple[str, yaml.Node, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{_where(node, source)}: {what}: expected a mapping")
    out = []
    seen: set[str] = set()
    for knode, vnode in node.value:
        key = _construct(knode)
        if not isinstance(key, str):
            raise ConfigError(f"{_where(knode, source)}: {what}: key {key!r} is not a string")
        if key in seen:
            raise ConfigError(f"{_where(knode, source)}: {what}.{key}: duplicate key" if what != "top level"
                              else f"{_where(knode, source)}: {key}: duplicate key")
        seen.add(key)
        out.append((key, knode, vnode))
    return out


def _parse_env_value(name: str, text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"environment {name}: cannot parse {text!r}: {e}") from None


def load(path: str | None = None, *, text: str | None = None,
         environ: Mapping[str, str] | None = None) -> Config:
    """Read and validate the configuration.

    ``path``: a YAML file (None: defaults only); ``text``: YAML given directly (tests).
    ``environ``: where to look for ``KTD_<SECTION>__<KEY>`` overrides (default ``os.environ``;
    pass ``{}`` to ignore the environment). Raises ``ConfigError`` with a one-line message.
    """
    environ = os.environ if environ is None else environ
    source = path or "<config>"
    if text is None and path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not UTF-8 text") from None
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    if text:
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f"{source}:{mark.line + 1}" if mark else source
            raise ConfigError(f"{at}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
        if root is not None and not (isinstance(root, yaml.ScalarNode) and root.value == ""):
            for section, knode, snode in _mapping_items(root, "top level", source):
                if section not in SECTIONS:
                    raise ConfigError(f"{_where(knode, source)}: unknown section {section!r} "
                                      f"(known: {', '.join(SECTIONS)})")
                if isinstance(snode, yaml.ScalarNode) and snode.tag.endswith(":null"):
                    continue  # an empty section keeps its defaults
                fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
                for key, kn, vn in _mapping_items(snode, section, source):
                    if key not in fields:
                        raise ConfigError(f"{_where(kn, source)}: unknown key {section}.{key} "
                                          f"(known: {', '.join(fields)})")
                    try:
                        raw = _construct(vn)
                    except yaml.YAMLError as e:
                        raise ConfigError(f"{_where(vn, source)}: {section}.{key}: {e}") from None
                    values[section][key] = _convert(f"{section}.{key}", fields[key].metadata, raw,
                                                    _where(vn, source))
    for name, text_value in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX):].lower().partition("__")
        if section not in SECTIONS:
            raise ConfigError(f"environment {name}: unknown section {section!r}")
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
        if key not in fields:
            raise ConfigError(f"environment {name}: unknown key {section}.{key}")
        raw = _parse_env_value(name, text_value)
        values[section][key] = _convert(f"{section}.{key}", fields[key].metadata, raw,
                                        f"environment {name}")
    cfg = Config(**{s: SECTIONS[s](**values[s]) for s in SECTIONS})
    _check_combinations(cfg, source)
    return cfg


def _check_combinations(cfg: Config, source: str) -> None:
    """Keys valid one by one that cannot hold together."""
    mc = cfg.model
    if mc.weights_map == "gguf" and mc.hugepages == "hugetlb":
        raise ConfigError(f"{source}: model.weights_map: gguf serves the weights from the model file's page "
                          "cache, which reserved huge pages cannot back, but model.hugepages: hugetlb requires "
                          "them (use hugepages: auto, thp or off, or weights_map: arena)")


def effective_weights_map(mc: ModelConfig) -> tuple[str, str]:
    """(the model.weights_map the engine is given, why it is not the configured one or ""). auto
    (the default) with hugepages: hugetlb is arena: reserved huge pages cannot back the file's
    page cache auto serves from after a cache miss, and a configuration that asked for hugetlb
    before auto was the default must keep starting (an explicit gguf is refused instead)."""
    if mc.weights_map == "auto" and mc.hugepages == "hugetlb":
        return "arena", ("model.weights_map: auto with model.hugepages: hugetlb is arena (reserved huge pages "
                         "cannot back the model file's page cache, which auto serves from after a cache miss)")
    return mc.weights_map, ""


def live_changes(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """Compare two configurations: (changed live keys, changed keys that need a restart)."""
    live, restart = [], []
    for section in SECTIONS:
        a, b = getattr(old, section), getattr(new, section)
        for f in dataclasses.fields(a):
            if getattr(a, f.name) != getattr(b, f.name):
                (live if f.metadata["live"] else restart).append(f"{section}.{f.name}")
    return live, restart


def apply_live(old: Config, new: Config) -> Config:
    """``old`` with the live keys taken from ``new`` (the restart-only keys stay as they were)."""
    sections = {}
    for section in SECTIONS:
        a, b = getattr(old, section), getattr(new, section)
        kept = {f.name: getattr(b if f.metadata["live"] else a, f.name) for f in dataclasses.fields(a)}
        sections[section] = SECTIONS[section](**kept)
    return Config(**sections)


def _fmt_default(meta: Mapping[str, Any], value: Any) -> str:
    if meta["kind"] == "mode":
        return f"0{value:o}"
    if meta["kind"] == "gpu_device" and value is None:
        return "off"
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def explain() -> str:
    """Every key with its default, unit, whether SIGHUP applies it, and its effect."""
    lines = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            m = f.metadata
            default = _fmt_default(m, f.default)
            unit = f" {m['unit']}" if m["unit"] else ""
            live = "live" if m["live"] else "restart"
            env = f"{ENV_PREFIX}{section.upper()}__{f.name.upper()}"
            lines.append(f"{section}.{f.name} = {default}{unit}  [{live}; env {env}]\n    {m['help']}")
    return "\n".join(lines)


def dump(cfg: Config) -> str:
    """The effective configuration as YAML (what `ktd config check` prints)."""
    out = []
    for section in SECTIONS:
        out.append(f"{section}:")
        sec = getattr(cfg, section)
        for f in dataclasses.fields(sec):
            v = getattr(sec, f.name)
            out.append(f"  {f.name}: {_fmt_default(f.metadata, v)}")
    return "\n".join(out) + "\n"
