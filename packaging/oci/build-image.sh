#!/usr/bin/env bash
# `make image`: the PyInstaller onedir (dist/edged) on a minimal Debian root, as an OCI image,
# with Debian tools only and no container registry: mmdebstrap builds the root from a Debian
# mirror (apt), umoci writes the OCI layout. Output: dist/oci/edged.oci.tar (an OCI archive):
#   podman load -i dist/oci/edged.oci.tar
#   skopeo copy oci-archive:dist/oci/edged.oci.tar docker://REGISTRY/edged:TAG
# The image runs as uid 10001 (edged), serves the model repository at /mnt/models on TCP 8080,
# and answers /v2/health/live|ready (the KServe probes in deploy/kserve/servingruntime.yaml).
# Needs root (or fakeroot-capable mmdebstrap modes), mmdebstrap and umoci. Not part of `make test`.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
onedir=${ONEDIR:-$repo/dist/edged}
out=${OUT:-$repo/dist/oci}
suite=${SUITE:-bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}
tag=${TAG:-latest}
uid=10001

for tool in mmdebstrap umoci; do
    command -v "$tool" >/dev/null || { echo "build-image.sh: $tool not found (apt-get install $tool)" >&2; exit 1; }
done
[[ -x $onedir/edged ]] || { echo "build-image.sh: $onedir/edged not found; run bash packaging/build.sh first" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)

# 1. A minimal Debian root: the Essential set (libc, coreutils, a shell for `kubectl exec`) plus
#    the C++ runtime the inference libraries link; no docs, man pages or apt lists.
mmdebstrap --variant=essential --include=libstdc++6,libgomp1,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*' \
    "$suite" "$work/rootfs.tar" "$mirror"

# 2. The image layout, a first layer with the Debian root, then edged on top.
layout=$work/layout
umoci init --layout "$layout"
umoci new --image "$layout:$tag"
umoci raw add-layer --image "$layout:$tag" "$work/rootfs.tar"
umoci unpack --image "$layout:$tag" "$work/bundle"
rootfs=$work/bundle/rootfs
mkdir -p "$rootfs/opt"
cp -a "$onedir" "$rootfs/opt/edged"
chown -R 0:0 "$rootfs/opt/edged"
chmod -R go-w "$rootfs/opt/edged"  # plugin ownership checks refuse group/world-writable dirs
echo "edged:x:$uid:$uid:edged:/var/lib/edged:/usr/sbin/nologin" >> "$rootfs/etc/passwd"
echo "edged:x:$uid:" >> "$rootfs/etc/group"
install -d -m 0755 "$rootfs/mnt/models"
install -d -m 0750 -o "$uid" -g "$uid" "$rootfs/var/lib/edged"
umoci repack --image "$layout:$tag" "$work/bundle"

# 3. How it runs: non-root, TCP 8080, the repository at /mnt/models, state in /var/lib/edged.
umoci config --image "$layout:$tag" \
    --author "edged packaging/oci/build-image.sh" \
    --config.user "$uid:$uid" \
    --config.workingdir /var/lib/edged \
    --config.entrypoint /opt/edged/edged \
    --config.cmd serve --config.cmd --http=0.0.0.0:8080 --config.cmd --socket=none \
    --config.cmd --model-repository=/mnt/models --config.cmd --state-dir=/var/lib/edged \
    --config.exposedports 8080/tcp \
    --config.volume /mnt/models \
    --config.env HOME=/var/lib/edged \
    --config.label org.opencontainers.image.title=edged
umoci gc --layout "$layout"

mkdir -p "$out"
rm -f "$out/edged.oci.tar"
tar -C "$layout" -cf "$out/edged.oci.tar" .
echo "build-image.sh: $out/edged.oci.tar ($(du -h "$out/edged.oci.tar" | cut -f1)) in $(( $(date +%s) - start )) s"
