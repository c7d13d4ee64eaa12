"""PyInstaller entry point for the frozen `edged` executable (the same CLI as `.venv/bin/edged`)."""

from daemon.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
