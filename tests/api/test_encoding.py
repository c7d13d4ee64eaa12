"""Choosing a response encoding from Accept-Encoding (daemon.api.encoding)."""

from __future__ import annotations


def test_response_encoding_follows_accept_encoding() -> None:
    from daemon.api.encoding import response_encoding

    assert response_encoding(None) is None and response_encoding("") is None
    assert response_encoding("gzip") == "gzip" and response_encoding("deflate") == "deflate"
    assert response_encoding("GZIP, deflate") == "gzip"  # a tie: the first listed
    assert response_encoding("gzip;q=0.5, deflate") == "deflate"
    assert response_encoding("deflate;q=0.4,gzip ; q=0.6") == "gzip"
    assert response_encoding("br, zstd, identity, *") is None
    assert response_encoding("gzip;q=0") is None and response_encoding("gzip;q=x") is None
