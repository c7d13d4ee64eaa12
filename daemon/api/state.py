"""What the transport holds, under typed app keys: the service (the data plane and its
lifecycle) and the codec. Handlers reach both through these; nothing lives in module globals."""

from __future__ import annotations

from aiohttp import web

from daemon.api.kserve_codec import Codec
from daemon.service import Service

SERVICE = web.AppKey("service", Service)
CODEC = web.AppKey("codec", Codec)


def daemon_of(request: web.Request) -> Service:
    return request.app[SERVICE]


def codec_of(request: web.Request) -> Codec:
    return request.app[CODEC]
