"""Real keys, real bundles and real release trees for the update tests (fixtures only: test
modules here cannot import each other under --import-mode=importlib)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from daemon.updates.bundle import create_bundle
from daemon.updates.keys import keygen
from daemon.updates.manifest import Manifest

Tree = dict[str, bytes]
Edit = Callable[[tarfile.TarInfo, bytes], tuple[tarfile.TarInfo, bytes] | None]


def _write_tree(root: Path, files: Tree) -> Path:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def _read_tree(root: Path) -> Tree:
    """Every regular file under root (through `current` when root is the link), except the
    release's own manifest.json."""
    root = root.resolve()
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).as_posix() != "manifest.json"
    }


def _rewrite_bundle(src: Path, dst: Path, edit: Edit,
                    extra: Iterable[tuple[tarfile.TarInfo, bytes]] = ()) -> Path:
    """Copy a bundle member by member through `edit` (None drops the member), adding `extra`."""
    with tarfile.open(src, "r:") as tin, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tout:
        for member in tin.getmembers():
            f = tin.extractfile(member)
            edited = edit(member, f.read() if f else b"")
            if edited is not None:
                info, body = edited
                info.size = len(body)
                tout.addfile(info, io.BytesIO(body))
        for info, body in extra:
            info.size = len(body) if info.isreg() else 0
            tout.addfile(info, io.BytesIO(body) if info.isreg() else None)
    return dst


@pytest.fixture
def write_tree() -> Callable[[Path, Tree], Path]:
    return _write_tree


@pytest.fixture
def read_tree() -> Callable[[Path], Tree]:
    return _read_tree


@pytest.fixture
def rewrite_bundle() -> Callable[..., Path]:
    return _rewrite_bundle


@pytest.fixture
def signing_key(tmp_path: Path) -> Path:
    """A fresh Ed25519 private key; its public half is in the `trusted_keys` directory."""
    (tmp_path / "trusted").mkdir()
    private = tmp_path / "signing.key"
    keygen(private, tmp_path / "trusted" / "fleet.pub")
    return private


@pytest.fixture
def trusted_keys(signing_key: Path) -> Path:
    return signing_key.parent / "trusted"


@pytest.fixture
def base_tree() -> Tree:
    return {
        "models/add/config.pbtxt": b'name: "add"\nbackend: "onnxruntime"\n',
        "models/add/1/model.onnx": b"onnx-add-v1" * 100,
        "models/old/1/model.onnx": b"old-model",
        "configs/edged.toml": b'[models]\ncontrol-mode = "poll"\n',
        "plugins/mybackend/manifest.toml": b'name = "mybackend"\n',
    }


@pytest.fixture
def make_bundle(tmp_path: Path, signing_key: Path) -> Callable[..., tuple[Path, Manifest]]:
    """make_bundle(files, sequence, version="1.0.0", targets=(), remove=()) -> (path, manifest)"""
    counter = iter(range(1_000_000))

    def make(files: Tree, sequence: int, version: str = "1.0.0",
             targets: Iterable[str] = (), remove: Iterable[str] = ()) -> tuple[Path, Manifest]:
        n = next(counter)
        src = _write_tree(tmp_path / f"src{n}", files)
        out = tmp_path / f"b{n}-{sequence}.edgebundle"
        manifest = create_bundle(src, out, signing_key, sequence=sequence, version=version,
                                 targets=list(targets), remove=list(remove))
        return out, manifest

    return make
