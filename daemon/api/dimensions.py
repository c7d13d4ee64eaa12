"""Embedding vectors as the OpenAI and Ollama routes both shorten them (`dimensions`)."""

from __future__ import annotations

import numpy as np

from daemon.errors import InvalidArgument


def check(dimensions: int | None) -> None:
    """Refuse a bad `dimensions` before any embedding is computed."""
    if dimensions is not None and dimensions < 1:
        raise InvalidArgument(f"dimensions must be >= 1, got {dimensions}")


def shorten(vectors: list[list[float]], dimensions: int) -> list[list[float]]:
    """The first `dimensions` components, L2-normalised again.

    This is how Matryoshka-trained models (OpenAI's text-embedding-3, nomic-embed, ...) are
    shortened; more dimensions than the model has is a 400.
    """
    size = len(vectors[0]) if vectors else 0
    if dimensions > size:
        raise InvalidArgument(f"dimensions: the model's embeddings have {size} dimensions, got {dimensions}")
    if dimensions == size:
        return vectors
    cut = np.asarray(vectors, dtype=np.float64)[:, :dimensions]
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return (cut / np.where(norms > 0, norms, 1.0)).tolist()
