"""Daemon configuration: file + flags, errors naming the key and the file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from daemon.cli import apply_flags, build_parser
from daemon.config import (
    DaemonConfig,
    default_socket_path,
    load_config,
    parse_host_port,
    parse_quantiles,
    socket_path,
)
from daemon.errors import ConfigError, EdgedError

REPO = Path(__file__).resolve().parent.parent


def test_shipped_example_config_is_valid_and_matches_defaults() -> None:
    assert load_config(REPO / "configs" / "edged.toml") == DaemonConfig()


def test_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    path = tmp_path / "edged.toml"
    path.write_text('[server]\nsoket = "/tmp/x.sock"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "soket" in info.value.message and str(path) in info.value.message
    assert "$.server" in info.value.message


def test_bad_value_names_path(tmp_path: Path) -> None:
    path = tmp_path / "edged.toml"
    path.write_text("[models]\npoll-secs = -1\n")
    with pytest.raises(ConfigError, match=r"models.*poll-secs"):
        load_config(path)


def test_invalid_toml(tmp_path: Path) -> None:
    path = tmp_path / "edged.toml"
    path.write_text("[server\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path)


def test_flags_override_file(tmp_path: Path) -> None:
    path = tmp_path / "edged.toml"
    path.write_text('[server]\nsocket = "/a.sock"\nhttp = "127.0.0.1:1"\n[models]\ncontrol-mode = "poll"\n')
    args = build_parser().parse_args(
        ["serve", "--socket", "/b.sock", "--model-control-mode", "explicit", "--load-model", "m",
         "--model-repository", "/r1", "--model-repository", "/r2"]
    )
    config = apply_flags(load_config(path), args)
    assert config.server.socket == "/b.sock"
    assert config.server.http == "127.0.0.1:1"  # from the file, not overridden
    assert config.models.control_mode == "explicit"
    assert config.models.load == ["m"] and config.models.repository == ["/r1", "/r2"]
    assert socket_path(config) == Path("/b.sock")


def test_default_socket_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/edged:/run/other")
    assert default_socket_path() == Path("/run/edged/edged.sock")
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket_path() == Path("/run/user/1000/edged/edged.sock")


def test_parse_host_port() -> None:
    assert parse_host_port("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_host_port(":8000") == ("127.0.0.1", 8000)
    assert parse_host_port("[::1]:9") == ("::1", 9)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        parse_host_port("localhost")
    assert parse_host_port("[fe80::1%eth0]:80") == ("fe80::1%eth0", 80)
    # Each of these the socket layer took as something else (port 99999 as another port,
    # "[::1:80" as ::1) or failed on with a traceback (a non-ASCII digit).
    for bad in ("[::1:80", "::1:80", "a:²", "a: 80", "a:-1", "[]:80", "a:800000"):
        with pytest.raises(ConfigError, match=r"must be HOST:PORT \(an IPv6 address in brackets"):
            parse_host_port(bad)
    for port in ("0", "65536", "99999"):
        with pytest.raises(ConfigError, match=f"the port must be 1 to 65535, got {int(port)}"):
            parse_host_port(f"127.0.0.1:{port}")


def test_tritons_cache_config_flag_sets_the_response_cache_size(tmp_path: Path) -> None:
    def flags(*argv: str) -> DaemonConfig:
        return apply_flags(load_config(None), build_parser().parse_args(["serve", *argv]))

    assert flags("--cache-config", "local,size=1048576").server.response_cache_size == "1048576"
    assert flags().server.response_cache_size == ""
    for bad in ("redis,host=x", "local,capacity=5", "local"):
        with pytest.raises(EdgedError, match="--cache-config must be local,size=BYTES"):
            flags("--cache-config", bad)
    with pytest.raises(EdgedError, match="response-cache-size: 'lots' is not a size"):
        flags("--cache-config", "local,size=lots")


def test_tritons_metrics_config_flag_sets_the_latency_metrics() -> None:
    def flags(*argv: str) -> DaemonConfig:
        return apply_flags(load_config(None), build_parser().parse_args(["serve", *argv]))

    metrics = flags("--metrics-config", "summary_latencies=true", "--metrics-config", "counter_latencies=false",
                    "--metrics-config", "summary_quantiles=0.5:0.05,0.75:0.01").metrics
    assert (metrics.summary_latencies, metrics.counter_latencies) == (True, False)
    assert parse_quantiles(metrics.summary_quantiles) == (0.5, 0.75)
    default = flags().metrics
    assert (default.summary_latencies, default.counter_latencies) == (False, True)
    assert parse_quantiles(default.summary_quantiles) == (0.5, 0.9, 0.95, 0.99, 0.999)
    # Triton 2.51 takes these and does nothing (it has no latency histogram); edged refuses.
    for bad in ("histogram_latencies=true", "summary_latencies=yes", "color=blue", "summary_latencies"):
        with pytest.raises(EdgedError, match=re.escape("--metrics-config must be counter_latencies=true|false, ")
                           + ".*" + re.escape(f"got {bad!r}")):
            flags("--metrics-config", bad)
    for bad in ("0.5", "1.5:0.01", "x:y", "0.5:0.05,"):
        with pytest.raises(EdgedError, match=r"summary-quantiles: .* is not <quantile>:<error> with a quantile in"):
            flags("--metrics-config", f"summary_quantiles={bad}")
