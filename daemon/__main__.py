"""`python -m daemon` runs the CLI (default: serve)."""

from daemon.cli import main

raise SystemExit(main())
