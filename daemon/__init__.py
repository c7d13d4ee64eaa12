"""edged: an edge inference daemon with pluggable backends over a local REST socket."""

__version__ = "0.1.0"
