"""`edged bundle keygen|create|verify` and `edged update apply|rollback|status`.

These work offline, on the release store directly, without a running daemon. Handlers return
an exit code; EdgedErrors propagate to `daemon.cli.main`, which prints them and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import msgspec

from daemon.config import DaemonConfig, trusted_keys_dir, updates_root
from daemon.updates.apply import apply_update
from daemon.updates.bundle import create_bundle, verify_bundle
from daemon.updates.errors import UpdateError
from daemon.updates.keys import keygen
from daemon.updates.store import ReleaseStore

# The daemon's defaults ([updates] root = <state-dir>/releases, keys = <config dir>/keys).
DEFAULT_ROOT = updates_root(DaemonConfig())
DEFAULT_KEYS = trusted_keys_dir(DaemonConfig())


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


def _cmd_apply(args: argparse.Namespace) -> int:
    _check_owner(args.root)
    store = ReleaseStore(args.root)
    _out("note: offline apply, no daemon involved: the health check is skipped. Reload the "
         "daemon (systemctl reload edged) to serve the new release.")
    result = asyncio.run(apply_update(
        args.bundle, store, args.keys, health_check=None, progress=_out, keep=args.keep,
    ))
    _out(f"current -> {result.release}")
    return 0


def _cmd_rollback(args: argparse.Namespace) -> int:
    _check_owner(args.root)
    release = ReleaseStore(args.root).rollback()
    _out(f"current -> {release.name}. Reload the daemon (systemctl reload edged) to serve it.")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    status = ReleaseStore(args.root).status()
    if args.json:
        _out(msgspec.json.format(msgspec.json.encode(status).decode(), indent=2))
        return 0
    _out(f"store:         {status.root}")
    _out(f"current:       {status.current or '-'}")
    _out(f"pending:       {status.pending or '-'}")
    _out(f"rollback to:   {status.rollback_to or '-'}")
    _out(f"last sequence: {status.last_sequence}")
    _out(f"releases:      {', '.join(status.releases) or '-'}")
    for entry in status.history[-5:]:
        _out(f"  {entry.at} {entry.action:<12} {entry.release} {entry.detail}".rstrip())
    return 0


def _store_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT,
                        help=f"release store directory (default {DEFAULT_ROOT})")


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

    p = update_sub.add_parser("apply", help="verify and apply a bundle (offline)")
    p.add_argument("bundle", type=Path)
    _store_flags(p)
    p.add_argument("--keys", type=Path, default=DEFAULT_KEYS,
                   help=f"trusted public keys directory (default {DEFAULT_KEYS})")
    p.add_argument("--keep", type=int, default=3, help="releases to keep (default 3)")
    p.set_defaults(handler=_cmd_apply)

    p = update_sub.add_parser("rollback", help="switch back to the previous committed release")
    _store_flags(p)
    p.set_defaults(handler=_cmd_rollback)

    p = update_sub.add_parser("status", help="show the release store")
    _store_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_cmd_status)
