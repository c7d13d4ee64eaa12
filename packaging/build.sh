#!/usr/bin/env bash
# Build the single-executable edged: dist/edged/edged (onedir) with plugins in dist/edged/backends/.
#   bash packaging/build.sh              # onedir (what we ship)
#   bash packaging/build.sh --onefile    # dist/onefile/edged, only for the start-time comparison
# Needs the repository's .venv with pyinstaller (`make test` or `make serve` creates it).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
pyinstaller=.venv/bin/pyinstaller
if [[ ! -x $pyinstaller ]]; then
    echo "build.sh: $repo/$pyinstaller not found; create the venv first (make test) -- pyinstaller is a dev extra" >&2
    exit 1
fi

distpath=dist workpath=build spec_args=()
if [[ ${1:-} == --onefile ]]; then
    distpath=dist/onefile workpath=build/onefile spec_args=(-- --onefile)
elif [[ $# -gt 0 ]]; then
    echo "usage: bash packaging/build.sh [--onefile]" >&2
    exit 2
fi

start=$(date +%s)
# Expected warning: libOpenCL.so.1 (needed by OpenVINO's Intel GPU plugin) is not bundled; it
# belongs to the host's GPU driver stack (intel-opencl-icd) and is loaded from there.
"$pyinstaller" --noconfirm --log-level WARN \
    --distpath "$distpath" --workpath "$workpath" \
    packaging/edged.spec "${spec_args[@]}"
echo "build.sh: built in $(( $(date +%s) - start )) s"

echo "build.sh: size of what ships (directory, then the executable itself):"
du -sh "$distpath/edged"
if [[ -d $distpath/edged ]]; then
    du -sh "$distpath/edged/edged"
fi
