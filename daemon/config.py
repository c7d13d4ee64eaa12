"""Daemon configuration: one TOML file, overridden by CLI flags, validated by msgspec.

Every key is optional; with no file at all the daemon serves the bundled demo repository on the
default Unix socket. Unknown keys are errors that name the key and the file.
"""

from __future__ import annotations

import math
import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from daemon.errors import ConfigError
from daemon.model_config import parse_keep_alive, parse_memory_size

ControlMode = Literal["none", "poll", "explicit"]
EventLoop = Literal["uvloop", "asyncio"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]


class _Section(msgspec.Struct, forbid_unknown_fields=True, rename="kebab", omit_defaults=True):
    pass


class ServerConfig(_Section):
    # "" = the default: $RUNTIME_DIRECTORY/edged.sock, /run/edged/edged.sock as root, else a
    # per-user runtime dir. "none" disables the Unix socket.
    socket: str = ""
    socket_mode: Annotated[str, msgspec.Meta(pattern=r"^0?[0-7]{3}$")] = "0660"
    # "HOST:PORT" enables TCP. Off by default: the socket's file permissions are the access control.
    http: str = ""
    max_request_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 64 * 1024 * 1024
    # Elements one input tensor may have, and bytes all of a request's inputs may decode into
    # (a BYTES element counts 48 bytes plus its payload); checked from the shapes before
    # anything is allocated. Over either: 400 naming the input and the setting.
    max_tensor_elements: Annotated[int, msgspec.Meta(ge=1)] = 1 << 24
    max_decoded_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 256 * 1024 * 1024
    # uids allowed on the Unix socket (checked with SO_PEERCRED); empty = whoever can open it.
    allowed_uids: list[int] = []
    shutdown_timeout: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    # File holding the bearer token TCP callers must send (`Authorization: Bearer ...`) for
    # admin routes (model load/unload, updates, logging, shared-memory registration), and for
    # every route but health when `tcp-auth = "all"`. No token file = admin over TCP refused.
    token_file: str = ""
    # "admin": inference over TCP is open, admin needs the token; "all": everything but
    # /v2/health/* needs it.
    tcp_auth: Literal["admin", "all"] = "admin"
    # Connections served at once (Unix socket and TCP together); more are answered 503 and closed.
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 512
    # A new connection must deliver its first request's headers within this many seconds, as
    # must headers arriving in pieces; a body must bring 1 KiB per this many seconds (408).
    header_timeout: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    # Idle keep-alive connections are closed after this many seconds.
    keepalive_timeout: Annotated[float, msgspec.Meta(gt=0)] = 15.0
    # Who may register and use system shared memory regions: callers on the Unix socket
    # ("socket"), those and TCP callers with the bearer token ("token"), any TCP caller as
    # in Triton ("all"), or nobody ("off"). See docs/operations.md and docs/security.md.
    shared_memory: Literal["socket", "token", "all", "off"] = "socket"
    # HTTP worker processes beside the daemon (daemon.api.workers): connections past the first
    # are served by a worker, which parses HTTP and answers infer requests through the daemon
    # (one copy of each model), so that HTTP uses more than one core. 0: the daemon serves every
    # connection on its one event loop.
    workers: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    # The host policy (a [host-policy.NAME] table with cpu-cores) whose CPUs the event loop
    # runs on; "" = wherever the OS puts it. See daemon.core.host_policy.
    host_policy: str = ""
    # The event loop of the daemon and its workers (daemon.eventloop): "uvloop" (C, on libuv)
    # or "asyncio" (the standard library's, for a platform without uvloop).
    event_loop: EventLoop = "uvloop"
    # Triton's response cache (--cache-config local,size=N): bytes ("64MiB", "1048576") of
    # answers kept for models whose config has response_cache { enable: true }; "" = none.
    response_cache_size: str = ""

    def __post_init__(self) -> None:
        if self.response_cache_size:
            try:
                parse_memory_size(self.response_cache_size)
            except ValueError as exc:
                raise ValueError(f"response-cache-size: {exc}") from None


class ModelsConfig(_Section):
    # Empty = the bundled demo repository, built under the state dir on first start.
    repository: list[str] = []
    control_mode: ControlMode = "none"
    poll_secs: Annotated[float, msgspec.Meta(gt=0)] = 15.0
    # Models loaded at start in explicit mode ("*" = all).
    load: list[str] = []


class BackendsConfig(_Section):
    # Empty = the `backends/` directory shipped beside the daemon.
    directories: list[str] = []
    poll_secs: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    # Refuse plugin directories that are group/world-writable or owned by someone else.
    check_ownership: bool = True


class UpdatesConfig(_Section):
    # Release store root; "" = <state dir>/releases.
    root: str = ""
    # Directory of trusted Ed25519 public keys; "" = <config dir>/keys.
    keys: str = ""
    # Watched directory (e.g. a mounted USB stick) for *.edgebundle files; "" = off.
    inbox: str = ""
    inbox_poll_secs: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    keep_releases: Annotated[int, msgspec.Meta(ge=1)] = 3
    # Largest bundle `POST /v1/updates` accepts, counted after any Content-Encoding is undone
    # (a small gzip body must not inflate into a full disk).
    max_bundle_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 8 * 1024**3


class ResidencyConfig(_Section):
    """On-demand model residency (daemon.core.residency): the memory budget loaded models share."""

    # "" = no budget; bytes ("6GiB", "512MiB", "2000000000") or a fraction of RAM ("75%").
    memory_budget: str = ""
    # keep_alive of an on-demand model whose config names none (Ollama duration: "5m", "30s", "-1").
    default_keep_alive: str = "5m"
    # A tensor model's estimated memory = its files' size x its backend's factor (default 1.5).
    backend_factors: dict[str, Annotated[float, msgspec.Meta(gt=0)]] = {}
    # Replace the estimate with the RSS growth measured around each on-demand load.
    measure: bool = True

    def __post_init__(self) -> None:
        # ValueError: msgspec reports it with the key's path.
        try:
            if self.memory_budget:
                parse_memory_size(self.memory_budget, total=1)
        except ValueError as exc:
            raise ValueError(f"memory-budget: {exc}") from None
        try:
            parse_keep_alive(self.default_keep_alive)
        except ValueError as exc:
            raise ValueError(f"default-keep-alive: {exc}") from None


class LoggingConfig(_Section):
    level: LogLevel = "info"
    format: LogFormat = "text"


class TraceConfig(_Section):
    # Where traced requests' timestamps go (Triton's --trace-config triton,file=...); "" =
    # tracing cannot be turned on. Not settable over HTTP, as in Triton.
    file: str = ""


class HostPolicy(_Section):
    """Triton's `--host-policy` settings, under the policy's name."""

    # The CPUs, as Triton writes them: "<lower>-<upper>" ranges separated by commas.
    cpu_cores: str = ""
    # Triton's other setting; refused when set (daemon.core.host_policy says why).
    numa_node: int | str | None = None


# Triton's default summary quantiles (quantile:error, its --metrics-config summary_quantiles).
DEFAULT_QUANTILES = "0.5:0.05,0.9:0.01,0.95:0.001,0.99:0.001,0.999:0.001"


def parse_quantiles(text: str) -> tuple[float, ...]:
    """Triton's `summary_quantiles` ("0.5:0.05,0.9:0.01"): the quantiles, each in (0, 1]. The
    error each pair gives is read but not needed: every quantile is estimated within 0.5 %
    (daemon.core.summary)."""
    found = []
    for pair in text.split(","):
        quantile, colon, error = pair.strip().partition(":")
        try:
            value, _ = float(quantile), float(error)
        except ValueError:
            value = math.nan
        if not colon or not 0 < value <= 1:
            raise ValueError(f"summary-quantiles: {pair.strip()!r} is not <quantile>:<error> with a quantile in (0, 1]")
        found.append(value)
    return tuple(found)


class MetricsConfig(_Section):
    """Which latency metrics each model exports (Triton's --metrics-config)."""

    # nv_inference_*_duration_us counters, and the response cache's per-model counters.
    counter_latencies: bool = True
    # nv_inference_*_summary_us summaries: count and sum since load, quantiles of the last minute.
    summary_latencies: bool = False
    summary_quantiles: str = DEFAULT_QUANTILES

    def __post_init__(self) -> None:
        parse_quantiles(self.summary_quantiles)  # ValueError: msgspec names the key


class RateLimitResource(_Section):
    """Copies of a rate limiter resource (Triton's --rate-limit-resource NAME:COUNT[:DEVICE])."""

    name: Annotated[str, msgspec.Meta(min_length=1)]
    count: Annotated[int, msgspec.Meta(ge=0)]
    # None: every device (a global resource ignores it).
    device: Annotated[int, msgspec.Meta(ge=0)] | None = None


class RateLimitConfig(_Section):
    """Triton's rate limiter: "off" ignores every instance group's rate_limiter."""

    mode: Literal["off", "execution_count"] = "off"
    # Default copies of a resource: the most any loaded instance asks for.
    resources: list[RateLimitResource] = []


class DaemonConfig(_Section):
    # Writable state (demo repo, caches); "" = $STATE_DIRECTORY, /var/lib/edged as root, else
    # ~/.local/state/edged.
    state_dir: str = ""
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    models: ModelsConfig = msgspec.field(default_factory=ModelsConfig)
    backends: BackendsConfig = msgspec.field(default_factory=BackendsConfig)
    updates: UpdatesConfig = msgspec.field(default_factory=UpdatesConfig)
    residency: ResidencyConfig = msgspec.field(default_factory=ResidencyConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    trace: TraceConfig = msgspec.field(default_factory=TraceConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    rate_limit: RateLimitConfig = msgspec.field(default_factory=RateLimitConfig)
    # Named CPU sets for model instances (instance_group.host_policy) and the event loop.
    host_policy: dict[str, HostPolicy] = {}


def load_config(path: Path | None) -> DaemonConfig:
    if path is None:
        return DaemonConfig()
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    try:
        return msgspec.convert(raw, DaemonConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def default_socket_path() -> Path:
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        # systemd may pass several colon-separated directories; ours is the first.
        return Path(runtime.split(":")[0]) / "edged.sock"
    if os.geteuid() == 0:
        return Path("/run/edged/edged.sock")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "edged" / "edged.sock"
    return Path(f"/tmp/edged-{os.getuid()}") / "edged.sock"


def default_state_dir() -> Path:
    state = os.environ.get("STATE_DIRECTORY")
    if state:
        return Path(state.split(":")[0])
    if os.geteuid() == 0:
        return Path("/var/lib/edged")
    return Path.home() / ".local" / "state" / "edged"


def default_config_dir() -> Path:
    conf = os.environ.get("CONFIGURATION_DIRECTORY")
    if conf:
        return Path(conf.split(":")[0])
    if os.geteuid() == 0:
        return Path("/etc/edged")
    return Path.home() / ".config" / "edged"


def socket_path(config: DaemonConfig) -> Path | None:
    if config.server.socket == "none":
        return None
    return Path(config.server.socket) if config.server.socket else default_socket_path()


def state_dir(config: DaemonConfig) -> Path:
    return Path(config.state_dir) if config.state_dir else default_state_dir()


def parse_host_port(value: str) -> tuple[str, int]:
    """server.http's HOST:PORT ("[::1]:8000" for IPv6, ":8000" for 127.0.0.1).

    Strict, because what it does not refuse the socket layer would reinterpret: port 99999
    came out as another port, and "[::1:80" listened on ::1."""
    match = re.fullmatch(r"(?:\[(?P<v6>[0-9A-Za-z:.%]+)\]|(?P<host>[^\[\]:\s]*)):(?P<port>[0-9]{1,5})", value)
    if match is None:
        raise ConfigError(f"server.http must be HOST:PORT (an IPv6 address in brackets: [::1]:8000), got {value!r}")
    port = int(match["port"])
    if not 1 <= port <= 65535:
        raise ConfigError(f"server.http: the port must be 1 to 65535, got {port}")
    return match["v6"] or match["host"] or "127.0.0.1", port


def updates_root(config: DaemonConfig) -> Path:
    return Path(config.updates.root) if config.updates.root else state_dir(config) / "releases"


def trusted_keys_dir(config: DaemonConfig) -> Path:
    return Path(config.updates.keys) if config.updates.keys else default_config_dir() / "keys"


def read_token(path: str) -> str | None:
    """The bearer token from `server.token-file` ("" = none). Refuses a file others can read."""
    if not path:
        return None
    file = Path(path)
    try:
        st = file.stat()
        token = file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"server.token-file {path}: {exc.strerror or exc}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"server.token-file {path} is readable by group or others; chmod 600 it")
    if len(token) < 16:
        raise ConfigError(f"server.token-file {path} holds a token shorter than 16 characters")
    return token
