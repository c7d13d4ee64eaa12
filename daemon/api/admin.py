"""Admin routes: backend plugins, hardware, offline updates."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from daemon.api.state import daemon_of
from daemon.core import uploads
from daemon.errors import InvalidArgument, PayloadTooLarge

log = logging.getLogger(__name__)

_json = msgspec.json.Encoder()
_CHUNK = 1 << 20
INFLATE_PIECE = 1 << 20


def _json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(payload), content_type="application/json")


def _query(request: web.Request, allowed: frozenset[str]) -> dict[str, str]:
    """The query parameters, refusing any this route does not implement (never ignored)."""
    unknown = sorted(set(request.query) - allowed)
    if unknown:
        raise InvalidArgument(f"unknown query parameter(s) for {request.path}: {', '.join(unknown)}")
    return dict(request.query)


def _bool_param(params: dict[str, str], name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None:
        return default
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise InvalidArgument(f"query parameter '{name}' must be true or false, got {value!r}")


async def backends(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    # Resolving imports plugin code (and its runtime): keep it off the event loop.
    infos = await asyncio.get_running_loop().run_in_executor(None, daemon.plugins.info)
    return _json_response({"backends": infos})


async def hardware(request: web.Request) -> web.Response:
    # Probes every fact not probed yet (imports OpenVINO, loads NVML): off the event loop.
    info = await asyncio.get_running_loop().run_in_executor(None, daemon_of(request).hardware.info)
    return _json_response(info)


async def update_status(request: web.Request) -> web.Response:
    _query(request, frozenset())
    return _json_response(daemon_of(request).releases.status())


class _Sink:
    """Writes a body to a file, inflating gzip/deflate as it goes, never past `limit` bytes
    of output (the server hands handlers the raw body: auto_decompress is off)."""

    def __init__(self, out: BinaryIO, encoding: str, limit: int) -> None:
        self.out = out
        self.encoding = encoding
        self.limit = limit
        self.size = 0
        self._inflater: Any = None
        if encoding == "gzip":
            self._inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._inflater = zlib.decompressobj(zlib.MAX_WBITS)
            self._raw_deflate_tried = False

    def _too_large(self) -> PayloadTooLarge:
        after = f", counted after {self.encoding} decoding" if self._inflater is not None else ""
        return PayloadTooLarge(f"bundle exceeds updates.max-bundle-bytes ({self.limit} bytes{after})")

    def write(self, chunk: bytes) -> None:
        """Runs on a worker thread: inflating and writing never block the event loop."""
        if self._inflater is None:
            self._put(chunk)
            return
        # Inflated a piece at a time: a 1 MiB chunk of a gzip bomb is up to ~1 GiB of output,
        # which one decompress() call held in memory at once.
        pending = chunk
        while pending:
            try:
                data = self._inflater.decompress(pending, min(INFLATE_PIECE, self.limit - self.size + 1))
            except zlib.error as exc:
                # HTTP clients send "deflate" zlib-wrapped or raw: retry raw once, at the start.
                if self.encoding == "deflate" and self.size == 0 and not self._raw_deflate_tried:
                    self._raw_deflate_tried = True
                    self._inflater = zlib.decompressobj(-zlib.MAX_WBITS)
                    self.write(chunk)
                    return
                raise InvalidArgument(f"body is not valid {self.encoding} data: {exc}") from None
            self._put(data)
            pending = self._inflater.unconsumed_tail

    def _put(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise self._too_large()
        self.out.write(data)

    def finish(self) -> None:
        if self._inflater is not None and not self._inflater.eof:
            raise InvalidArgument(f"{self.encoding} body is truncated")


async def _receive(request: web.Request, path: Path, limit: int) -> int:
    """Stream the body to `path`; returns the bundle's size (after any Content-Encoding)."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        encoding = "identity"
    elif encoding not in ("gzip", "deflate"):
        raise InvalidArgument(
            f"unsupported Content-Encoding {encoding!r} (use gzip, deflate or identity)")
    try:
        with path.open("wb") as out:
            sink = _Sink(out, encoding, limit)
            async for chunk in request.content.iter_chunked(_CHUNK):
                await asyncio.to_thread(sink.write, chunk)
            sink.finish()
    except (HttpProcessingError, web.RequestPayloadError) as exc:
        detail = " ".join(str(exc).split())
        raise InvalidArgument(f"request body could not be read: {detail}") from None
    return sink.size


async def apply_update(request: web.Request) -> web.Response:
    """`curl --unix-socket S --data-binary @bundle.edgebundle http://localhost/v1/updates`.

    `?commit=false` leaves a healthy release installed but pending (two-phase, for fleet
    managers): `POST /v1/updates/commit` or `POST /v1/updates/rollback` finishes it. The body is
    streamed to disk (bundles hold models: they may exceed the request size cap), up to
    `updates.max-bundle-bytes`.
    """
    daemon = daemon_of(request)
    commit = _bool_param(_query(request, frozenset({"commit"})), "commit", True)
    limit = daemon.config.updates.max_bundle_bytes
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"bundle of {request.content_length} bytes exceeds "
                              f"updates.max-bundle-bytes ({limit} bytes)")
    incoming = uploads.incoming_dir(daemon.state_dir)
    incoming.mkdir(parents=True, exist_ok=True)
    path = incoming / f"{uuid.uuid4().hex}{uploads.INCOMING_SUFFIX}"
    progress: list[str] = []

    async def receive_and_apply() -> object:
        try:
            if await _receive(request, path, limit) == 0:
                raise InvalidArgument(
                    "request body must be the bundle file (e.g. curl --data-binary @FILE)")
            return await daemon.releases.apply(path, progress.append, commit=commit)
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    task = asyncio.ensure_future(receive_and_apply())
    try:
        # A client that hangs up while the update runs must not cancel it half-way.
        applied = await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_log_orphan)
        raise
    return _json_response({"applied": applied, "progress": progress})


def _log_orphan(task: asyncio.Future[object]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("update whose client went away failed: %s", task.exception())


async def commit(request: web.Request) -> web.Response:
    _query(request, frozenset())
    return _json_response({"committed": await daemon_of(request).releases.commit()})


async def rollback(request: web.Request) -> web.Response:
    only_pending = _bool_param(_query(request, frozenset({"only_pending"})), "only_pending", False)
    release = await daemon_of(request).releases.rollback(only_pending=only_pending)
    return _json_response({"current": release.name if release is not None else None})


async def reload(request: web.Request) -> web.Response:
    """Serve the store's `current` release and health-check it: what `edged update apply` asks
    of a running daemon after it switched the store (422 if a model fails)."""
    _query(request, frozenset())
    releases = daemon_of(request).releases
    models = await releases.check_current()
    current = releases.store.current_release()
    return _json_response({"current": current.name if current else None, "models": models})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v2/backends", backends)
    app.router.add_get("/v2/hardware", hardware)
    app.router.add_get("/v1/updates", update_status)
    app.router.add_post("/v1/updates", apply_update)
    app.router.add_post("/v1/updates/commit", commit)
    app.router.add_post("/v1/updates/rollback", rollback)
    app.router.add_post("/v1/updates/reload", reload)
