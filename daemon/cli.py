"""Command line: `edged [serve] [flags]`, `edged backends`, `edged hardware`, bundles and updates.

Flags override the config file; the config file overrides the built-in defaults.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

import msgspec

from daemon import __version__
from daemon.config import ControlMode, DaemonConfig, EventLoop, LogFormat, LogLevel, load_config
from daemon.errors import EdgedError
from daemon.ops.kserve import add_kserve_flags, apply_kserve_flags


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file (see configs/edged.toml)")
    parser.add_argument("--socket", help="Unix socket path, or 'none' to disable it")
    parser.add_argument("--http", metavar="HOST:PORT", help="also listen on TCP (off by default)")
    parser.add_argument("--workers", type=int, metavar="N", help="HTTP worker processes (server.workers)")
    parser.add_argument("--event-loop", choices=get_args(EventLoop),
                        help="the event loop of the daemon and its workers (server.event-loop)")
    parser.add_argument("--host-policy", action="append", metavar="NAME,SETTING=VALUE",
                        help="as Triton's: a host policy setting, e.g. cpu,cpu-cores=0-1 ([host-policy.NAME])")
    parser.add_argument("--cache-config", action="append", metavar="local,size=BYTES",
                        help="as Triton's: the response cache's size (server.response-cache-size)")
    parser.add_argument("--metrics-config", action="append", metavar="SETTING=VALUE",
                        help="as Triton's: counter_latencies, summary_latencies (true/false), "
                             "summary_quantiles (Q:ERROR,...) ([metrics])")
    parser.add_argument("--rate-limit", type=str.lower, choices=("off", "execution_count"),
                        help="as Triton's: execution_count makes executions wait for the resources "
                             "of their instance group's rate_limiter (rate-limit.mode)")
    parser.add_argument("--rate-limit-resource", action="append", metavar="NAME:COUNT[:DEVICE]",
                        help="as Triton's: copies of a rate limiter resource, on one device or every "
                             "one; repeatable (rate-limit.resources)")
    parser.add_argument("--server-host-policy", metavar="NAME",
                        help="the host policy whose CPUs the event loop runs on (server.host-policy)")
    parser.add_argument("--model-repository", action="append", metavar="DIR",
                        help="model repository (Triton layout); repeatable")
    parser.add_argument("--model-control-mode", choices=get_args(ControlMode))
    parser.add_argument("--repository-poll-secs", type=float)
    parser.add_argument("--load-model", action="append", metavar="NAME",
                        help="model to load at start in explicit mode ('*' = all); repeatable")
    parser.add_argument("--backend-directory", action="append", metavar="DIR",
                        help="directory of backend plugins; repeatable")
    parser.add_argument("--state-dir", help="writable state directory")
    parser.add_argument("--log-level", choices=get_args(LogLevel))
    parser.add_argument("--log-format", choices=get_args(LogFormat))
    add_kserve_flags(parser)


def apply_flags(config: DaemonConfig, args: argparse.Namespace) -> DaemonConfig:
    """Return the config with every flag the user gave written over it."""
    raw = msgspec.to_builtins(config)
    server, models, backends, logging_ = (
        raw.setdefault(k, {}) for k in ("server", "models", "backends", "logging")
    )
    if args.socket is not None:
        server["socket"] = args.socket
    if args.http is not None:
        server["http"] = args.http
    if args.workers is not None:
        server["workers"] = args.workers
    if args.event_loop is not None:
        server["event-loop"] = args.event_loop
    if args.server_host_policy is not None:
        server["host-policy"] = args.server_host_policy
    for flag in args.host_policy or []:
        # Triton's --host-policy=<name>,<setting>=<value>; the value may hold commas.
        name, _, setting = flag.partition(",")
        key, equals, value = setting.partition("=")
        if not name or not equals:
            raise EdgedError(f"invalid command-line flag: --host-policy must be NAME,SETTING=VALUE, got {flag!r}")
        raw.setdefault("host-policy", {}).setdefault(name, {})[key] = value
    for flag in args.cache_config or []:
        # Triton's --cache-config=<cache>,<setting>=<value>; its local cache has one setting.
        cache, _, setting = flag.partition(",")
        key, equals, value = setting.partition("=")
        if cache != "local" or key != "size" or not equals:
            raise EdgedError(
                f"invalid command-line flag: --cache-config must be local,size=BYTES (Triton's local cache), got {flag!r}"
            )
        server["response-cache-size"] = value
    for flag in args.metrics_config or []:
        key, equals, value = flag.partition("=")
        if key in ("counter_latencies", "summary_latencies") and value in ("true", "false"):
            raw.setdefault("metrics", {})[key.replace("_", "-")] = value == "true"
        elif key == "summary_quantiles" and equals:
            raw.setdefault("metrics", {})["summary-quantiles"] = value
        else:
            # Triton 2.51 ignores what it does not know (histogram_latencies included: it
            # exports no latency histogram); a flag that does nothing is refused here.
            raise EdgedError(
                "invalid command-line flag: --metrics-config must be counter_latencies=true|false, "
                f"summary_latencies=true|false or summary_quantiles=Q:ERROR,..., got {flag!r}"
            )
    if args.rate_limit is not None:
        raw.setdefault("rate-limit", {})["mode"] = args.rate_limit
    for flag in args.rate_limit_resource or []:
        parts = flag.split(":")
        try:
            # Triton's --rate-limit-resource=<name>:<count>[:<device>]
            if len(parts) not in (2, 3) or not parts[0]:
                raise ValueError
            numbers = [int(part) for part in parts[1:]]
            if min(numbers) < 0:
                raise ValueError
            resource: dict[str, object] = {"name": parts[0], "count": numbers[0]}
            if len(numbers) == 2:
                resource["device"] = numbers[1]
        except ValueError:
            raise EdgedError(
                f"invalid command-line flag: --rate-limit-resource must be NAME:COUNT or NAME:COUNT:DEVICE, got {flag!r}"
            ) from None
        raw.setdefault("rate-limit", {}).setdefault("resources", []).append(resource)
    if args.model_repository:
        models["repository"] = args.model_repository
    if args.model_control_mode:
        models["control-mode"] = args.model_control_mode
    if args.repository_poll_secs is not None:
        models["poll-secs"] = args.repository_poll_secs
    if args.load_model:
        models["load"] = args.load_model
    if args.backend_directory:
        backends["directories"] = args.backend_directory
    if args.state_dir:
        raw["state-dir"] = args.state_dir
    if args.log_level:
        logging_["level"] = args.log_level
    if args.log_format:
        logging_["format"] = args.log_format
    try:
        return msgspec.convert(raw, DaemonConfig)
    except msgspec.ValidationError as exc:
        raise EdgedError(f"invalid command-line flag: {exc}") from None


def _cmd_serve(args: argparse.Namespace) -> int:
    from daemon import eventloop
    from daemon.logs import setup_logging
    from daemon.server import serve

    config = apply_kserve_flags(apply_flags(load_config(args.config), args), args)
    setup_logging(config.logging.level, config.logging.format)
    eventloop.run(serve(config), config.server.event_loop)
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    from daemon.api.worker import run_worker

    return run_worker()


def _cmd_hardware(args: argparse.Namespace) -> int:
    from daemon.core.hardware import probe_hardware

    sys.stdout.write(msgspec.json.format(msgspec.json.encode(probe_hardware()).decode(), indent=2) + "\n")
    return 0


def _cmd_backends(args: argparse.Namespace) -> int:
    from daemon.core.plugins import PluginRegistry
    from daemon.service import shipped_backends_dir

    dirs = [Path(d) for d in args.backend_directory or []] or [shipped_backends_dir()]
    registry = PluginRegistry(dirs)
    registry.scan()
    for info in registry.info():
        # The runtime's version too: for llama.cpp it names the CPU features its library has.
        detail = info.reason or "  ".join(filter(None, (", ".join(info.devices), info.runtime_version)))
        sys.stdout.write(f"{info.name:<12} {info.state:<12} {info.version:<8} {detail}\n")
    return 0


def build_parser(*, with_updates: bool = True) -> argparse.ArgumentParser:
    """`with_updates=False` leaves out the bundle/update commands, whose module imports
    `cryptography`: `edged serve` starts without it."""
    parser = argparse.ArgumentParser(prog="edged", description="Edge inference daemon")
    parser.add_argument("--version", action="version", version=f"edged {__version__}")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the daemon (the default)")
    _serve_flags(serve)
    serve.set_defaults(handler=_cmd_serve)
    # Started by the daemon itself (daemon.api.workers), never by hand.
    worker = sub.add_parser("worker")
    worker.set_defaults(handler=_cmd_worker)
    hardware = sub.add_parser("hardware", help="show what the hardware probe sees")
    hardware.set_defaults(handler=_cmd_hardware)
    backends = sub.add_parser("backends", help="list backend plugins and whether they can run here")
    backends.add_argument("--backend-directory", action="append", metavar="DIR")
    backends.set_defaults(handler=_cmd_backends)
    if not with_updates:
        return parser
    try:
        from daemon.updates.cli import add_commands
    except ImportError:  # updates need `cryptography`; the daemon serves without them
        pass
    else:
        add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    known = {"serve", "worker", "hardware", "backends", "bundle", "update", "-h", "--help", "--version"}
    if not argv or argv[0] not in known:
        argv = ["serve", *argv]  # `edged --http :8000` means `edged serve --http :8000`
    parser = build_parser(with_updates=argv[0] not in ("serve", "worker", "hardware", "backends"))
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except EdgedError as exc:
        sys.stderr.write(f"edged: error: {exc.message}\n")
        return 2
    except KeyboardInterrupt:
        return 130
