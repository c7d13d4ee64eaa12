"""Bundle files: create (sign) and verify.

Layout of the tar: `manifest.json`, `manifest.sig` (raw 64-byte Ed25519 signature of the exact
manifest bytes), then `payload/<path>` for each listed file. Only regular files: no directory
entries, links or devices. Verification reads the tar without extracting anything.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

import msgspec

from daemon.updates.errors import UpdateError
from daemon.updates.keys import check_signature, load_private_key, load_trusted_keys
from daemon.updates.manifest import (
    CATEGORIES,
    FORMAT_VERSION,
    KIND_OF_CATEGORY,
    BundleFile,
    Manifest,
    Replaces,
    decode_manifest,
    encode_manifest,
    split_path,
)

BUNDLE_SUFFIX = ".edgebundle"
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
PAYLOAD = "payload/"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
_CHUNK = 1024 * 1024


def _hash_stream(stream: IO[bytes]) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    while chunk := stream.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _source_files(src_dir: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """(payload path, file) for every file under src_dir/{models,configs,plugins}, and the
    payload paths of the directories inside an entry there that hold nothing (an ensemble's
    version directory). An empty entry itself ships nothing: it would delete the live one."""
    found: list[tuple[str, Path]] = []
    empty: list[str] = []
    for entry in sorted(src_dir.iterdir()):
        if entry.name not in CATEGORIES:
            raise UpdateError(f"{entry} is not models/, configs/ or plugins/; a bundle holds "
                              "only those")
        if entry.is_symlink() or not entry.is_dir():
            raise UpdateError(f"{entry} must be a directory")
        for dirpath, dirnames, filenames in os.walk(entry):
            dirnames.sort()
            if not dirnames and not filenames and Path(dirpath).parent not in (src_dir, entry):
                empty.append(Path(dirpath).relative_to(src_dir).as_posix())
            for name in [*dirnames, *sorted(filenames)]:
                path = Path(dirpath, name)
                if path.is_symlink():
                    raise UpdateError(f"{path} is a symbolic link; bundles carry regular files only")
                if name in filenames:
                    if not path.is_file():
                        raise UpdateError(f"{path} is not a regular file")
                    found.append((path.relative_to(src_dir).as_posix(), path))
    return found, empty


class _Hashing(io.RawIOBase):
    """A read-only stream that hashes what tarfile reads, to catch a file changing between the
    manifest pass and the copy pass."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.digest = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = self._f.read(len(buffer))
        buffer[: len(data)] = data
        self.digest.update(data)
        return len(data)


def _tarinfo(name: str, size: int, mtime: float, mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = int(mtime)
    info.mode = mode
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def create_bundle(
    src_dir: Path,
    out_path: Path,
    private_key_path: Path,
    sequence: int,
    version: str,
    targets: Sequence[str] = (),
    remove: Iterable[str] = (),
    created: datetime | None = None,
) -> Manifest:
    """Sign `src_dir` ({models,configs,plugins}/...) into the bundle `out_path`.

    Every top-level entry shipped replaces the live one wholesale; `remove` names more entries
    ("models/old_model") to drop from the release without shipping a replacement.
    """
    src_dir, out_path = Path(src_dir), Path(out_path)
    key = load_private_key(private_key_path)
    sources, directories = _source_files(src_dir)
    replaces: dict[str, set[str]] = {c: set() for c in CATEGORIES}
    files: list[BundleFile] = []
    for rel, path in sources:
        category, name = split_path(rel)
        replaces[category].add(name)
        with path.open("rb") as f:
            sha, size = _hash_stream(f)
        files.append(BundleFile(path=rel, sha256=sha, size=size, kind=KIND_OF_CATEGORY[category]))
    for directory in directories:
        category, name = split_path(directory)
        replaces[category].add(name)
    for item in remove:
        try:
            category, name = split_path(item.rstrip("/") + "/x")
        except ValueError as exc:
            raise UpdateError(f"cannot remove {item!r}: {exc}") from None
        replaces[category].add(name)
    try:
        manifest = Manifest(
            format=FORMAT_VERSION,
            bundle_version=version,
            sequence=sequence,
            created=created or datetime.now(UTC).replace(microsecond=0),
            targets=list(targets),
            files=files,
            replaces=Replaces(**{c: sorted(replaces[c]) for c in CATEGORIES}),
            directories=directories,
        )
        # Struct() does not run Meta constraints; a round trip through the decoder does.
        data = encode_manifest(manifest)
        manifest = msgspec.json.decode(data, type=Manifest)
    except (ValueError, msgspec.ValidationError) as exc:
        raise UpdateError(f"cannot create bundle: {exc}") from None
    signature = key.sign(data)
    mtime = manifest.created.timestamp()

    tmp = out_path.with_name(out_path.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(_tarinfo(MANIFEST, len(data), mtime), io.BytesIO(data))
        tar.addfile(_tarinfo(SIGNATURE, len(signature), mtime), io.BytesIO(signature))
        for entry, (_, path) in zip(manifest.files, sources, strict=True):
            mode = 0o755 if os.access(path, os.X_OK) else 0o644
            with path.open("rb") as f:
                reader = _Hashing(f)
                tar.addfile(_tarinfo(PAYLOAD + entry.path, entry.size, mtime, mode),
                            io.BufferedReader(reader))
            if reader.digest.hexdigest() != entry.sha256:
                tmp.unlink()
                raise UpdateError(f"{path} changed while the bundle was being written")
    os.replace(tmp, out_path)
    return manifest


def _open(path: Path) -> tarfile.TarFile:
    try:
        # "r:" = uncompressed only: model files barely compress, and one format is less to trust.
        return tarfile.open(path, "r:")
    except (OSError, tarfile.TarError) as exc:
        raise UpdateError(f"bundle {path} is not a readable tar archive: {exc}") from None


def _members(tar: tarfile.TarFile, path: Path) -> dict[str, tarfile.TarInfo]:
    members: dict[str, tarfile.TarInfo] = {}
    for member in tar.getmembers():
        name = member.name
        parts = name.split("/")
        if name.startswith("/") or ".." in parts:
            raise UpdateError(f"bundle {path}: member {name!r} has an unsafe path")
        if not member.isreg():
            what = ("a symbolic link" if member.issym() else "a hard link" if member.islnk()
                    else "a directory" if member.isdir() else "a special file")
            raise UpdateError(f"bundle {path}: member {name!r} is {what}; bundles hold regular "
                              "files only")
        if name in members:
            raise UpdateError(f"bundle {path}: member {name!r} appears twice")
        members[name] = member
    return members


def _read_small(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], name: str,
                path: Path, limit: int) -> bytes:
    member = members.get(name)
    if member is None:
        raise UpdateError(f"bundle {path} has no {name}")
    if member.size > limit:
        raise UpdateError(f"bundle {path}: {name} is {member.size} bytes, over the {limit} limit")
    f = tar.extractfile(member)
    assert f is not None  # a regular file, checked in _members
    return f.read()


def verify_bundle(path: Path, trusted_keys_dir: Path) -> Manifest:
    """Check a bundle completely and return its manifest; UpdateError names what is wrong.

    The signature is checked before the manifest is parsed; then every payload member must be
    listed, every listed file present, with the listed size and sha256.
    """
    path = Path(path)
    keys = load_trusted_keys(trusted_keys_dir)
    try:
        with _open(path) as tar:
            members = _members(tar, path)
            data = _read_small(tar, members, MANIFEST, path, MAX_MANIFEST_BYTES)
            signature = _read_small(tar, members, SIGNATURE, path, 1024)
            check_signature(data, signature, keys, Path(trusted_keys_dir))
            manifest = decode_manifest(data)
            expected = {PAYLOAD + f.path: f for f in manifest.files}
            extra = sorted(set(members) - set(expected) - {MANIFEST, SIGNATURE})
            if extra:
                raise UpdateError(f"bundle {path}: member {extra[0]!r} is not in the manifest")
            for name, entry in expected.items():
                member = members.get(name)
                if member is None:
                    raise UpdateError(f"bundle {path}: {entry.path} is in the manifest but "
                                      "missing from the payload")
                if member.size != entry.size:
                    raise UpdateError(f"bundle {path}: {entry.path} is {member.size} bytes, the "
                                      f"manifest says {entry.size}")
                f = tar.extractfile(member)
                assert f is not None
                sha, _ = _hash_stream(f)
                if sha != entry.sha256:
                    raise UpdateError(f"bundle {path}: {entry.path} does not match its sha256 in "
                                      "the manifest (modified after signing)")
    except (OSError, EOFError, tarfile.TarError) as exc:
        raise UpdateError(f"bundle {path} is damaged or truncated: {exc}") from None
    return manifest


def _payload_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    # Strip the payload/ prefix, then let the standard "data" filter refuse anything that could
    # escape `dest` (absolute paths, '..', links, devices) and drop setuid/group-write bits.
    renamed = member.replace(name=member.name.removeprefix(PAYLOAD), deep=False)
    return tarfile.data_filter(renamed, dest)


def extract_payload(path: Path, manifest: Manifest, dest: Path) -> None:
    """Extract the files of a verified manifest into `dest` and check them again there.

    The bundle may sit on removable media and change after verify_bundle() read it, so the
    extracted copy (which is what will be served) is hashed against the trusted manifest.
    """
    try:
        with _open(path) as tar:
            members = _members(tar, path)
            wanted = []
            for entry in manifest.files:
                member = members.get(PAYLOAD + entry.path)
                if member is None:
                    raise UpdateError(f"bundle {path}: {entry.path} disappeared from the payload")
                wanted.append(member)
            tar.extractall(dest, members=wanted, filter=_payload_filter)
    except (OSError, EOFError, tarfile.TarError) as exc:
        raise UpdateError(f"bundle {path}: extraction failed: {exc}") from None
    try:
        for directory in manifest.directories:  # safe paths: the manifest checked each
            (dest / directory).mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a signed manifest naming a directory below a file
        raise UpdateError(f"bundle {path}: cannot make a directory it lists: {exc}") from None
    for entry in manifest.files:
        target = dest / entry.path
        with target.open("rb") as f:
            sha, size = _hash_stream(f)
        if (sha, size) != (entry.sha256, entry.size):
            raise UpdateError(f"bundle {path}: {entry.path} changed after verification")
