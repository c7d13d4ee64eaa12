"""Bundle creation and verification with real Ed25519 keys and hand-crafted hostile tars."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from daemon.updates.bundle import create_bundle, extract_payload, verify_bundle
from daemon.updates.errors import UpdateError
from daemon.updates.keys import keygen, load_private_key
from daemon.updates.manifest import Manifest

Tree = dict[str, bytes]
BundleMaker = Callable[..., tuple[Path, Manifest]]
Rewrite = Callable[..., Path]


def _same(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return info, data


def test_create_and_verify(make_bundle: BundleMaker, trusted_keys: Path, base_tree: Tree) -> None:
    bundle, created = make_bundle(base_tree, sequence=7, version="2.1.0", targets=[">=0.1"])
    manifest = verify_bundle(bundle, trusted_keys)
    assert manifest == created
    assert (manifest.sequence, manifest.bundle_version, manifest.targets) == (7, "2.1.0", [">=0.1"])
    by_path = {f.path: f for f in manifest.files}
    assert sorted(by_path) == sorted(base_tree)
    for rel, data in base_tree.items():
        assert by_path[rel].sha256 == hashlib.sha256(data).hexdigest()
        assert by_path[rel].size == len(data)
    assert by_path["models/add/1/model.onnx"].kind == "model"
    assert by_path["plugins/mybackend/manifest.toml"].kind == "plugin"
    assert manifest.replaces.models == ["add", "old"]
    assert manifest.replaces.configs == ["edged.toml"]
    assert manifest.replaces.plugins == ["mybackend"]
    with tarfile.open(bundle) as tar:
        names = tar.getnames()
    assert names[:2] == ["manifest.json", "manifest.sig"]
    assert sorted(names[2:]) == sorted("payload/" + p for p in base_tree)


def test_extract_payload(make_bundle: BundleMaker, trusted_keys: Path, base_tree: Tree,
                         read_tree: Callable[[Path], Tree], tmp_path: Path) -> None:
    bundle, _ = make_bundle(base_tree, sequence=1)
    manifest = verify_bundle(bundle, trusted_keys)
    dest = tmp_path / "out"
    dest.mkdir()
    extract_payload(bundle, manifest, dest)
    assert read_tree(dest) == base_tree


def test_any_trusted_key_verifies(make_bundle: BundleMaker, trusted_keys: Path,
                                  base_tree: Tree, tmp_path: Path) -> None:
    keygen(tmp_path / "other.key", trusted_keys / "a-older.pub")  # sorted before fleet.pub
    bundle, _ = make_bundle(base_tree, sequence=1)
    assert verify_bundle(bundle, trusted_keys).sequence == 1


def test_wrong_key(make_bundle: BundleMaker, base_tree: Tree, tmp_path: Path) -> None:
    bundle, _ = make_bundle(base_tree, sequence=1)
    other = tmp_path / "other-trust"
    other.mkdir()
    keygen(tmp_path / "other.key", other / "other.pub")
    with pytest.raises(UpdateError, match=r"does not match any of the 1 trusted key"):
        verify_bundle(bundle, other)


def test_tampered_payload(make_bundle: BundleMaker, trusted_keys: Path, base_tree: Tree,
                          rewrite_bundle: Rewrite, tmp_path: Path) -> None:
    bundle, _ = make_bundle(base_tree, sequence=1)

    def flip(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
        if info.name == "payload/models/add/1/model.onnx":
            data = b"X" + data[1:]  # same size, different bytes
        return info, data

    bad = rewrite_bundle(bundle, tmp_path / "bad.edgebundle", flip)
    with pytest.raises(UpdateError, match=r"models/add/1/model.onnx does not match its sha256"):
        verify_bundle(bad, trusted_keys)

    def grow(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
        return info, data + b"!" if info.name == "payload/models/old/1/model.onnx" else data

    bad = rewrite_bundle(bundle, tmp_path / "bad2.edgebundle", grow)
    with pytest.raises(UpdateError, match=r"models/old/1/model.onnx is 10 bytes, the manifest says 9"):
        verify_bundle(bad, trusted_keys)
    # The untouched original still verifies: the failures above come from the edits.
    assert verify_bundle(bundle, trusted_keys).sequence == 1


def test_tampered_manifest(make_bundle: BundleMaker, trusted_keys: Path, base_tree: Tree,
                           rewrite_bundle: Rewrite, tmp_path: Path) -> None:
    bundle, _ = make_bundle(base_tree, sequence=1)

    def bump(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
        if info.name == "manifest.json":
            raw = msgspec.json.decode(data)
            raw["sequence"] = 99  # a replay dressed up as new
            data = msgspec.json.encode(raw)
        return info, data

    bad = rewrite_bundle(bundle, tmp_path / "bad.edgebundle", bump)
    with pytest.raises(UpdateError, match=r"not signed by a trusted key or was modified"):
        verify_bundle(bad, trusted_keys)

    def strip_sig(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes] | None:
        return None if info.name == "manifest.sig" else (info, data)

    unsigned = rewrite_bundle(bundle, tmp_path / "unsigned.edgebundle", strip_sig)
    with pytest.raises(UpdateError, match=r"has no manifest.sig"):
        verify_bundle(unsigned, trusted_keys)


def test_truncated_bundle(make_bundle: BundleMaker, trusted_keys: Path, base_tree: Tree,
                          tmp_path: Path) -> None:
    bundle, _ = make_bundle(base_tree, sequence=1)
    data = bundle.read_bytes()
    with tarfile.open(bundle) as tar:
        last = tar.getmembers()[-1]
    # Inside the last file's data, inside its header, and in the middle, start and nothing.
    # (Cutting only the zero blocks at the very end leaves every member intact, which is fine.)
    cuts = (last.offset_data + last.size // 2, last.offset + 10, len(data) // 2, 700, 100, 0)
    for cut in cuts:
        short = tmp_path / f"short{cut}.edgebundle"
        short.write_bytes(data[:cut])
        with pytest.raises(UpdateError, match=r"truncated|not a readable tar|has no manifest|missing"):
            verify_bundle(short, trusted_keys)


def test_missing_and_extra_members(make_bundle: BundleMaker, trusted_keys: Path,
                                   base_tree: Tree, rewrite_bundle: Rewrite,
                                   tmp_path: Path) -> None:
    bundle, _ = make_bundle(base_tree, sequence=1)
    drop = rewrite_bundle(
        bundle, tmp_path / "drop.edgebundle",
        lambda i, d: None if i.name == "payload/configs/edged.toml" else (i, d),
    )
    with pytest.raises(UpdateError, match=r"configs/edged.toml is in the manifest but missing"):
        verify_bundle(drop, trusted_keys)

    smuggled = tarfile.TarInfo("payload/models/add/1/extra.so")
    extra = rewrite_bundle(bundle, tmp_path / "extra.edgebundle", _same,
                           extra=[(smuggled, b"\x7fELF")])
    with pytest.raises(UpdateError, match=r"'payload/models/add/1/extra.so' is not in the manifest"):
        verify_bundle(extra, trusted_keys)

    # A second member of the same name would win at extraction time after the first was hashed.
    twice = rewrite_bundle(bundle, tmp_path / "twice.edgebundle", _same,
                           extra=[(tarfile.TarInfo("payload/configs/edged.toml"), b"evil")])
    with pytest.raises(UpdateError, match=r"appears twice"):
        verify_bundle(twice, trusted_keys)


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


def _dir(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info


@pytest.mark.parametrize(
    ("member", "body", "message"),
    [
        (tarfile.TarInfo("../evil"), b"pwned", "unsafe path"),
        (tarfile.TarInfo("payload/../../evil"), b"pwned", "unsafe path"),
        (tarfile.TarInfo("/tmp/evil-abs"), b"pwned", "unsafe path"),
        (_link("payload/models/add/1/link", "/etc/passwd", tarfile.SYMTYPE), b"",
         "is a symbolic link"),
        (_link("payload/models/add/1/hard", "/etc/passwd", tarfile.LNKTYPE), b"",
         "is a hard link"),
        (_dir("payload/models/add/2"), b"", "is a directory"),
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "symlink", "hardlink", "directory"],
)
def test_hostile_members(make_bundle: BundleMaker, trusted_keys: Path, base_tree: Tree,
                         rewrite_bundle: Rewrite, tmp_path: Path,
                         member: tarfile.TarInfo, body: bytes, message: str) -> None:
    bundle, _ = make_bundle(base_tree, sequence=1)
    bad = rewrite_bundle(bundle, tmp_path / "bad.edgebundle", _same, extra=[(member, body)])
    with pytest.raises(UpdateError, match=message):
        verify_bundle(bad, trusted_keys)


def _signed_tar(path: Path, signing_key: Path, manifest: bytes,
                payload: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    sig = load_private_key(signing_key).sign(manifest)
    with tarfile.open(path, "w") as tar:
        for name, data in (("manifest.json", manifest), ("manifest.sig", sig)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info, data in payload:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _raw_manifest(path: str, data: bytes, **overrides: object) -> bytes:
    raw: dict[str, object] = {
        "format": 1, "bundle_version": "1.0.0", "sequence": 1,
        "created": "2025-01-01T00:00:00Z", "targets": [],
        "files": [{"path": path, "sha256": hashlib.sha256(data).hexdigest(),
                   "size": len(data), "kind": "model"}],
        "replaces": {"models": ["m"]},
    }
    raw.update(overrides)
    return msgspec.json.encode(raw)


@pytest.mark.parametrize("path", ["models/../../evil", "/models/evil", "models//evil", "evil",
                                  "models/m/../../../evil"])
def test_signed_manifest_with_traversal_path_is_refused(
    signing_key: Path, trusted_keys: Path, tmp_path: Path, path: str
) -> None:
    # Even a correctly signed manifest cannot name a path outside the release.
    data = b"pwned"
    bundle = _signed_tar(tmp_path / "evil.edgebundle", signing_key, _raw_manifest(path, data),
                         [(tarfile.TarInfo("payload/" + path.lstrip("/")), data)])
    with pytest.raises(UpdateError, match=r"unsafe|must be under"):
        verify_bundle(bundle, trusted_keys)


def test_signed_manifest_with_unknown_field_is_refused(
    signing_key: Path, trusted_keys: Path, tmp_path: Path
) -> None:
    data = b"weights"
    manifest = _raw_manifest("models/m/1/model.onnx", data, post_install="rm -rf /")
    bundle = _signed_tar(tmp_path / "x.edgebundle", signing_key, manifest,
                         [(tarfile.TarInfo("payload/models/m/1/model.onnx"), data)])
    with pytest.raises(UpdateError, match=r"manifest.json is invalid.*post_install"):
        verify_bundle(bundle, trusted_keys)


def test_hand_signed_bundle_verifies(signing_key: Path, trusted_keys: Path, tmp_path: Path) -> None:
    # The control for the two tests above: the same construction with a good path passes.
    data = b"weights"
    bundle = _signed_tar(tmp_path / "ok.edgebundle", signing_key,
                         _raw_manifest("models/m/1/model.onnx", data),
                         [(tarfile.TarInfo("payload/models/m/1/model.onnx"), data)])
    assert verify_bundle(bundle, trusted_keys).files[0].path == "models/m/1/model.onnx"


def test_extraction_rechecks_the_bundle(make_bundle: BundleMaker, trusted_keys: Path,
                                        base_tree: Tree, rewrite_bundle: Rewrite,
                                        tmp_path: Path) -> None:
    # The bundle changes between verification and extraction (e.g. on a USB stick).
    bundle, _ = make_bundle(base_tree, sequence=1)
    manifest = verify_bundle(bundle, trusted_keys)

    def flip(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
        return info, (b"Y" + data[1:]) if info.name.endswith("model.onnx") else data

    swapped = rewrite_bundle(bundle, tmp_path / "swap.edgebundle", flip)
    os.replace(swapped, bundle)
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(UpdateError, match=r"changed after verification"):
        extract_payload(bundle, manifest, dest)


def test_create_refuses_links_and_strays(signing_key: Path, tmp_path: Path,
                                         write_tree: Callable[[Path, Tree], Path]) -> None:
    out = tmp_path / "b.edgebundle"
    src = write_tree(tmp_path / "src", {"models/m/1/model.onnx": b"w"})
    (src / "models" / "m" / "1" / "alias.onnx").symlink_to("model.onnx")
    with pytest.raises(UpdateError, match=r"is a symbolic link"):
        create_bundle(src, out, signing_key, sequence=1, version="1.0")
    stray = write_tree(tmp_path / "src2", {"bin/tool": b"x"})
    with pytest.raises(UpdateError, match=r"not models/, configs/ or plugins/"):
        create_bundle(stray, out, signing_key, sequence=1, version="1.0")
    ok = write_tree(tmp_path / "src3", {"models/m/1/model.onnx": b"w"})
    with pytest.raises(UpdateError, match=r"bundle_version"):
        create_bundle(ok, out, signing_key, sequence=1, version="../1")
    with pytest.raises(UpdateError, match=r"sequence"):
        create_bundle(ok, out, signing_key, sequence=0, version="1.0")
    assert not out.exists()
    create_bundle(ok, out, signing_key, sequence=1, version="1.0")
    assert out.exists()


def test_keys(signing_key: Path, trusted_keys: Path, tmp_path: Path,
              write_tree: Callable[[Path, Tree], Path]) -> None:
    with pytest.raises(UpdateError, match=r"refusing to overwrite"):
        keygen(signing_key, tmp_path / "new.pub")
    assert signing_key.stat().st_mode & 0o077 == 0
    src = write_tree(tmp_path / "src", {"models/m/1/model.onnx": b"w"})
    bundle = tmp_path / "b.edgebundle"
    create_bundle(src, bundle, signing_key, sequence=1, version="1.0")
    assert verify_bundle(bundle, trusted_keys).sequence == 1
    # A private key dropped into the trust store is an error, not silently skipped.
    (trusted_keys / "oops.pem").write_bytes(signing_key.read_bytes())
    with pytest.raises(UpdateError, match=r"oops.pem is not a PEM public key"):
        verify_bundle(bundle, trusted_keys)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UpdateError, match=r"no trusted keys"):
        verify_bundle(bundle, empty)


def test_empty_directories_travel_in_the_manifest(signing_key: Path, trusted_keys: Path, tmp_path: Path) -> None:
    """An ensemble's version directory holds no file, and Triton's layout needs it: the
    manifest lists it (the payload holds regular files only) and extraction makes it."""
    src = tmp_path / "src"
    (src / "models" / "pipe" / "1").mkdir(parents=True)
    (src / "models" / "pipe" / "config.pbtxt").write_bytes(b'platform: "ensemble"\n')
    (src / "models" / "blank" / "2" / "empty").mkdir(parents=True)
    (src / "models" / "nothing").mkdir()  # an empty entry ships nothing (it would delete the live one)
    bundle = tmp_path / "b.edgebundle"
    created = create_bundle(src, bundle, signing_key, 1, "1.0.0")
    manifest = verify_bundle(bundle, trusted_keys)
    assert manifest == created
    assert manifest.directories == ["models/blank/2/empty", "models/pipe/1"]
    assert manifest.replaces.models == ["blank", "pipe"]
    dest = tmp_path / "out"
    dest.mkdir()
    extract_payload(bundle, manifest, dest)
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")) == [
        "models", "models/blank", "models/blank/2", "models/blank/2/empty",
        "models/pipe", "models/pipe/1", "models/pipe/config.pbtxt",
    ]


def test_a_manifest_with_no_empty_directory_leaves_the_field_out(
    make_bundle: BundleMaker, base_tree: Tree
) -> None:
    # Daemons from before `directories` refuse unknown fields: they still read such bundles.
    bundle, _ = make_bundle(base_tree, sequence=1)
    with tarfile.open(bundle) as tar:
        member = tar.extractfile("manifest.json")
        assert member is not None
        data = member.read()
    assert b'"files"' in data and b"directories" not in data


@pytest.mark.parametrize(("directories", "error"), [
    (["models/../../evil"], "unsafe"),
    (["/models/m/evil"], "unsafe"),
    (["evil"], "must be under"),
    (["models/m/1", "models/m/1"], "listed twice"),
    (["models/m/1/model.onnx"], "listed twice, or as a file and a directory"),
    (["models/other/1"], r"replaces.models must list \['other'\]"),
    (["models/m/1/model.onnx/below"], "cannot make a directory"),
])
def test_a_signed_manifest_with_a_bad_directory_is_refused(
    signing_key: Path, trusted_keys: Path, tmp_path: Path, directories: list[str], error: str
) -> None:
    data = b"weights"
    bundle = _signed_tar(tmp_path / "d.edgebundle", signing_key,
                         _raw_manifest("models/m/1/model.onnx", data, directories=directories),
                         [(tarfile.TarInfo("payload/models/m/1/model.onnx"), data)])
    with pytest.raises(UpdateError, match=error):
        manifest = verify_bundle(bundle, trusted_keys)
        dest = tmp_path / "out"
        dest.mkdir()
        extract_payload(bundle, manifest, dest)
