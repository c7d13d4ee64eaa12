"""`edged bundle keygen|create|verify` and `edged update apply|commit|rollback|status`.

`edged update` works on the release store directly, through the same `apply_update` as the
daemon's HTTP route. When a daemon answers on its socket, it is asked to serve the switched
release and health-check it (that is the apply's health check); otherwise the apply is offline
and the daemon serves `current` when it starts or reloads (SIGHUP). Handlers return an exit
code; EdgedErrors propagate to `daemon.cli.main`, which prints them and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import msgspec

from daemon.config import DaemonConfig, default_socket_path, trusted_keys_dir, updates_root
from daemon.updates.apply import apply_update, commit_update, rollback_update
from daemon.updates.bundle import create_bundle, verify_bundle
from daemon.updates.daemon_link import DaemonLink
from daemon.updates.errors import UpdateError
from daemon.updates.keys import keygen
from daemon.updates.store import ReleaseStore

# The daemon's defaults ([updates] root = <state-dir>/releases, keys = <config dir>/keys).
DEFAULT_ROOT = updates_root(DaemonConfig())
DEFAULT_KEYS = trusted_keys_dir(DaemonConfig())
DEFAULT_SOCKET = default_socket_path()


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")


def _cmd_keygen(args: argparse.Namespace) -> int:
    fp = keygen(args.private, args.public)
    _out(f"wrote {args.private} (keep it secret, off the devices) and {args.public} ({fp})")
    _out(f"install {args.public.name} into the devices' trusted keys directory ({DEFAULT_KEYS})")
    return 0


def _cmd_create(args: argparse.Namespace) -> int:
    manifest = create_bundle(
        args.src, args.out, args.key, sequence=args.sequence, version=args.version,
        targets=args.target or [], remove=args.remove or [],
    )
    _out(f"wrote {args.out}: bundle {manifest.bundle_version}, sequence {manifest.sequence}, "
         f"{len(manifest.files)} files, {manifest.payload_bytes} bytes")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    manifest = verify_bundle(args.bundle, args.keys)
    if args.json:
        _out(msgspec.json.format(msgspec.json.encode(manifest).decode(), indent=2))
        return 0
    _out(f"{args.bundle}: OK, bundle {manifest.bundle_version}, sequence {manifest.sequence}, "
         f"created {manifest.created.isoformat()}")
    _out(f"  targets: {', '.join(manifest.targets) or 'any daemon version'}")
    for category in ("models", "configs", "plugins"):
        names = manifest.replaces.of(category)
        if names:
            _out(f"  {category}: {', '.join(names)}")
    return 0


def _check_owner(root: Path) -> None:
    """Refuse to write a store as root when the daemon's user owns it: root-owned releases and
    state would be unwritable for the daemon's own updates afterwards."""
    try:
        owner = root.stat().st_uid
    except FileNotFoundError:
        return
    if os.geteuid() == 0 and owner != 0:
        raise UpdateError(f"{root} belongs to uid {owner}; run this as that user, e.g. "
                          f"`runuser -u edged -- edged update ...`")


def _daemon(args: argparse.Namespace) -> DaemonLink | None:
    """The running daemon to reload and health-check through, or None (offline)."""
    link = None if args.offline else DaemonLink(args.socket, timeout=args.timeout)
    if link is not None and link.reachable():
        _out(f"daemon at {args.socket}: it will serve and health-check the release")
        return link
    why = "--offline" if link is None else f"no daemon answers on {args.socket}"
    _out(f"note: {why}: offline, no health check. The daemon serves the store's current "
         "release when it starts or reloads (systemctl reload edged).")
    return None


def _cmd_apply(args: argparse.Namespace) -> int:
    _check_owner(args.root)
    store = ReleaseStore(args.root)
    link = _daemon(args)
    result = asyncio.run(apply_update(
        args.bundle, store, args.keys,
        health_check=link.health_check if link else None,
        restore=link.restore if link else None,
        progress=_out, keep=args.keep, commit=not args.no_commit,
    ))
    _out(f"current -> {result.release}" + ("" if result.committed else " (pending)"))
    return 0


def _cmd_commit(args: argparse.Namespace) -> int:
    _check_owner(args.root)
    done = asyncio.run(commit_update(ReleaseStore(args.root), keep=args.keep))
    _out(f"committed {done.release}" + (f", pruned {', '.join(done.pruned)}" if done.pruned else ""))
    return 0


def _cmd_rollback(args: argparse.Namespace) -> int:
    _check_owner(args.root)
    store = ReleaseStore(args.root)
    before = store.current_release()
    link = _daemon(args)
    failed: list[str] = []

    async def restore(release: Path | None) -> None:
        if link is None:
            return
        try:
            await link.restore(release)
        except UpdateError as exc:  # the switch back stands; say what the daemon reported
            failed.append(exc.message)

    release = asyncio.run(rollback_update(store, restore, only_pending=args.if_pending))
    if args.if_pending and release == before:
        _out(f"nothing pending; current stays {release.name if release else 'nothing'}")
        return 0
    _out(f"current -> {release.name if release else 'nothing'}")
    for message in failed:
        _out(f"warning: the daemon reloaded, but its health check failed: {message}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    status = ReleaseStore(args.root).status()
    if args.json:
        _out(msgspec.json.format(msgspec.json.encode(status).decode(), indent=2))
        return 0
    _out(f"store:         {status.root}")
    _out(f"current:       {status.current or '-'}")
    _out(f"pending:       {status.pending or '-'}"
         + (" (installed: commit or roll back)" if status.pending_installed else ""))
    _out(f"rollback to:   {status.rollback_to or '-'}")
    _out(f"last sequence: {status.last_sequence}")
    _out(f"releases:      {', '.join(status.releases) or '-'}")
    for entry in status.history[-5:]:
        _out(f"  {entry.at} {entry.action:<12} {entry.release} {entry.detail}".rstrip())
    return 0


def _store_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT,
                        help=f"release store directory (default {DEFAULT_ROOT})")


def _daemon_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", type=Path, default=DEFAULT_SOCKET,
                        help=f"the running daemon's Unix socket (default {DEFAULT_SOCKET})")
    parser.add_argument("--offline", action="store_true",
                        help="do not contact a running daemon (no health check)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for the daemon's reload and health check")


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register `bundle` and `update` with their subcommands; each sets `handler`."""
    bundle = subparsers.add_parser("bundle", help="create and check signed update bundles")
    bundle_sub = bundle.add_subparsers(dest="bundle_command", required=True)

    p = bundle_sub.add_parser("keygen", help="make an Ed25519 signing key pair")
    p.add_argument("--private", type=Path, required=True, help="private key file to create")
    p.add_argument("--public", type=Path, required=True, help="public key file (*.pub) to create")
    p.set_defaults(handler=_cmd_keygen)

    p = bundle_sub.add_parser("create", help="sign a directory of models/ configs/ plugins/")
    p.add_argument("src", type=Path, help="directory holding models/, configs/ and/or plugins/")
    p.add_argument("--out", type=Path, required=True, help="bundle file to write (*.edgebundle)")
    p.add_argument("--key", type=Path, required=True, help="private signing key")
    p.add_argument("--sequence", type=int, required=True,
                   help="fleet-wide increasing number; devices refuse anything not newer")
    p.add_argument("--version", required=True, help="bundle version, e.g. 1.4.0")
    p.add_argument("--target", action="append", metavar="SPEC",
                   help="daemon versions it is for, e.g. '>=0.1' (repeatable, all must hold)")
    p.add_argument("--remove", action="append", metavar="CATEGORY/NAME",
                   help="entry to drop from the release, e.g. models/old (repeatable)")
    p.set_defaults(handler=_cmd_create)

    p = bundle_sub.add_parser("verify", help="check a bundle's signature and contents")
    p.add_argument("bundle", type=Path)
    p.add_argument("--keys", type=Path, default=DEFAULT_KEYS,
                   help=f"trusted public keys directory (default {DEFAULT_KEYS})")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(handler=_cmd_verify)

    update = subparsers.add_parser("update", help="apply bundles to the release store")
    update_sub = update.add_subparsers(dest="update_command", required=True)

    p = update_sub.add_parser("apply", help="verify, apply and health-check a bundle")
    p.add_argument("bundle", type=Path)
    _store_flags(p)
    _daemon_flags(p)
    p.add_argument("--keys", type=Path, default=DEFAULT_KEYS,
                   help=f"trusted public keys directory (default {DEFAULT_KEYS})")
    p.add_argument("--keep", type=int, default=3, help="releases to keep (default 3)")
    p.add_argument("--no-commit", action="store_true",
                   help="two-phase: leave the release installed but pending until "
                        "`edged update commit` or `edged update rollback`")
    p.set_defaults(handler=_cmd_apply)

    p = update_sub.add_parser("commit", help="commit the pending release (after apply --no-commit)")
    _store_flags(p)
    p.add_argument("--keep", type=int, default=3, help="releases to keep (default 3)")
    p.set_defaults(handler=_cmd_commit)

    p = update_sub.add_parser("rollback", help="undo the pending release, or switch back to the "
                                               "previous committed release")
    _store_flags(p)
    _daemon_flags(p)
    p.add_argument("--if-pending", action="store_true",
                   help="only undo a pending release; with none, do nothing (exit 0)")
    p.set_defaults(handler=_cmd_rollback)

    p = update_sub.add_parser("status", help="show the release store")
    _store_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_cmd_status)
