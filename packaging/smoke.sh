#!/usr/bin/env bash
# Smoke test of the frozen build (bash packaging/build.sh first):
#   start dist/edged/edged under a fake systemd notify socket -> READY=1 from the main pid ->
#   infer on the demo models over the Unix socket -> every plugin that is ready from source is
#   ready frozen -> SIGTERM -> STOPPING=1 and exit code 0; then --workers 1, a signed bundle,
#   and SIGHUP picking up an OpenVINO model and a tiny GGUF that generates. Prints start->READY
#   time.
#   EDGED_BIN=path/to/edged bash packaging/smoke.sh   tests another binary.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${EDGED_BIN:-$repo/dist/edged/edged}
helper=$repo/packaging/smoke_helper.py
ready_timeout=${EDGED_READY_TIMEOUT:-120}

keep_logs=0
fail() { echo "smoke.sh: FAIL: $*" >&2; keep_logs=1; exit 1; }
[[ -x $bin ]] || fail "$bin not found; run bash packaging/build.sh first"
# The checks need some python3, not the frozen one: the system's, else the venv's.
py=$(command -v python3 || true)
[[ -n $py ]] || py=$repo/.venv/bin/python
[[ -x $py ]] || fail "no python3 to run the checks"

tmp=$(mktemp -d /tmp/edged-smoke.XXXXXX)  # short: sun_path holds 108 bytes
daemon_pid='' listener_pid=''
cleanup() {
    # `|| true`: under set -e a failing kill (process already gone) would end the trap early.
    if [[ -n $listener_pid ]]; then kill "$listener_pid" 2>/dev/null || true; fi
    if [[ -n $daemon_pid ]]; then kill -KILL "$daemon_pid" 2>/dev/null || true; fi
    wait 2>/dev/null || true
    if [[ $keep_logs == 1 && -d $tmp ]]; then
        echo "--- edged log ---" >&2; cat "$tmp/edged.log" >&2 || true
        echo "--- notify log ---" >&2; cat "$tmp/notify.log" >&2 || true
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT

http() {  # http PATH [BODY-FILE]: print the body; non-zero on a non-2xx status
    if command -v curl >/dev/null; then
        curl --silent --show-error --fail-with-body --max-time 60 --unix-socket "$tmp/edged.sock" \
            ${2:+-H 'Content-Type: application/json' --data-binary "@$2"} "http://localhost$1"
    else
        "$py" "$helper" http "$tmp/edged.sock" "$@"
    fi
}

# Fake systemd: a datagram socket that logs what the daemon sends, with the sender's pid.
"$py" "$helper" listen "$tmp/notify.sock" "$tmp/notify.log" &
listener_pid=$!
for _ in $(seq 50); do [[ -S $tmp/notify.sock ]] && break; sleep 0.1; done
[[ -S $tmp/notify.sock ]] || fail "notify listener did not start"
: >"$tmp/notify.log"

start=$(date +%s.%N)
NOTIFY_SOCKET=$tmp/notify.sock "$bin" serve --socket "$tmp/edged.sock" --state-dir "$tmp/state" \
    >"$tmp/edged.log" 2>&1 &
daemon_pid=$!

deadline=$((SECONDS + ready_timeout))
until grep -q 'READY=1' "$tmp/notify.log"; do
    kill -0 "$daemon_pid" 2>/dev/null || fail "edged exited before READY=1"
    ((SECONDS < deadline)) || fail "no READY=1 within ${ready_timeout}s"
    sleep 0.02
done
read -r ready_at ready_pid _ < <(grep 'READY=1' "$tmp/notify.log" | head -n1)
ready_s=$(awk -v a="$ready_at" -v b="$start" 'BEGIN { printf "%.2f", a - b }')
# NotifyAccess=main: systemd drops notifications from any pid but the one it started.
[[ $ready_pid == "$daemon_pid" ]] || fail "READY=1 came from pid $ready_pid, not the started pid $daemon_pid"
echo "smoke.sh: READY=1 from pid $daemon_pid after ${ready_s}s"
# The default event loop (server.event-loop) is bundled: a missing uvloop would have stopped
# the start above; the log says which loop runs.
grep -q 'event loop: uvloop ' "$tmp/edged.log" || fail "the daemon is not on uvloop (server.event-loop)"

"$py" "$helper" infer-body >"$tmp/infer.json"
for model in simple simple_python; do
    http "/v2/models/$model/infer" "$tmp/infer.json" >"$tmp/reply.json" || fail "infer on $model"
    "$py" "$helper" check-infer "$model" <"$tmp/reply.json" || fail "wrong numbers from $model"
    echo "smoke.sh: $model: OUTPUT0/OUTPUT1 match sum/difference"
done

# Freezing must lose no runtime: whatever is ready from source must be ready frozen.
expected=onnxruntime
if [[ -x $repo/.venv/bin/edged ]]; then
    expected=$("$repo/.venv/bin/edged" backends | awk '$2 == "ready" { print $1 }' | tr '\n' ' ')
fi
http /v2/backends >"$tmp/backends.json" || fail "GET /v2/backends"
# shellcheck disable=SC2086  # one argument per plugin name
"$py" "$helper" check-backends onnxruntime $expected <"$tmp/backends.json" || fail "backends not ready"

kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=''
[[ $rc == 0 ]] || fail "edged exited with $rc after SIGTERM"
for _ in $(seq 20); do grep -q 'STOPPING=1' "$tmp/notify.log" && break; sleep 0.05; done
grep -q 'STOPPING=1' "$tmp/notify.log" || fail "no STOPPING=1 received"
echo "smoke.sh: SIGTERM -> STOPPING=1, exit code 0"

# HTTP workers (server.workers): the executable starts itself again as `edged worker`; a second
# connection is served by it; SIGTERM stops the worker with the daemon.
"$bin" serve --socket "$tmp/edged.sock" --state-dir "$tmp/state" --workers 1 >"$tmp/edged.log" 2>&1 &
daemon_pid=$!
deadline=$((SECONDS + ready_timeout))
until http /v2/health/ready >/dev/null 2>&1; do
    kill -0 "$daemon_pid" 2>/dev/null || fail "edged --workers 1 exited before it was ready"
    ((SECONDS < deadline)) || fail "edged --workers 1 not ready within ${ready_timeout}s"
    sleep 0.05
done
worker_pids=$(cat /proc/"$daemon_pid"/task/*/children 2>/dev/null || true)
[[ -n $worker_pids ]] || fail "edged --workers 1 started no worker process"
"$py" "$helper" second-connection "$tmp/edged.sock" /v2/models/simple/infer "$tmp/infer.json" >"$tmp/reply.json" \
    || fail "infer through a worker"
"$py" "$helper" check-infer simple <"$tmp/reply.json" || fail "wrong numbers through a worker"
for pid in $worker_pids; do  # its loop too, now that it served: uvloop's extension is mapped in
    grep -q 'uvloop/loop\.' /proc/"$pid"/maps || fail "worker $pid is not on uvloop"
done
kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=''
[[ $rc == 0 ]] || fail "edged --workers 1 exited with $rc after SIGTERM"
for pid in $worker_pids; do
    ! kill -0 "$pid" 2>/dev/null || fail "worker $pid still running after the daemon stopped"
done
echo "smoke.sh: --workers 1: a second connection served by the worker process; it stops with the daemon"

# Signed bundles (offline updates): cryptography's library works inside the executable
# (packaging/strip_debug.py changed the libraries; nothing above signs or verifies).
mkdir -p "$tmp/bundle/src/configs" "$tmp/bundle/keys"
echo '# smoke' >"$tmp/bundle/src/configs/smoke.toml"
"$bin" bundle keygen --private "$tmp/bundle/k.pem" --public "$tmp/bundle/keys/k.pub" >/dev/null \
    || fail "edged bundle keygen"
"$bin" bundle create --out "$tmp/bundle/b.tar" --key "$tmp/bundle/k.pem" --sequence 1 --version 0.0.1 \
    "$tmp/bundle/src" >/dev/null || fail "edged bundle create"
"$bin" bundle verify --keys "$tmp/bundle/keys" "$tmp/bundle/b.tar" >"$tmp/bundle/verify.txt" \
    || fail "edged bundle verify: $(cat "$tmp/bundle/verify.txt")"
grep -q ': OK, bundle 0.0.1, sequence 1' "$tmp/bundle/verify.txt" || fail "bundle not verified: $(cat "$tmp/bundle/verify.txt")"
echo "smoke.sh: a bundle signed and verified (Ed25519)"

# SIGHUP picks up a new model: the demo ONNX model again, on OpenVINO (its ONNX frontend is a
# library found at run time, which `ready` above does not prove). Tests RELOADING=1 -> READY=1.
# The bundled demo repository is read-only package data, so this run serves a writable copy.
if [[ " $expected " == *" openvino "* ]]; then
    demo=$tmp/repo
    bundled=$(dirname "$bin")/_internal/daemon/demo_models
    [[ -d $bundled ]] || fail "the demo repository is not bundled at $bundled"
    cp -r "$bundled" "$demo"
    : >"$tmp/notify.log"
    NOTIFY_SOCKET=$tmp/notify.sock "$bin" serve --socket "$tmp/edged.sock" --state-dir "$tmp/state" \
        --model-repository "$demo" >"$tmp/edged.log" 2>&1 &
    daemon_pid=$!
    deadline=$((SECONDS + ready_timeout))
    until grep -q 'READY=1' "$tmp/notify.log"; do
        kill -0 "$daemon_pid" 2>/dev/null || fail "edged exited before READY=1 (second run)"
        ((SECONDS < deadline)) || fail "no READY=1 within ${ready_timeout}s (second run)"
        sleep 0.02
    done
    mkdir -p "$demo/simple_openvino/1"
    cp "$demo/simple/1/model.onnx" "$demo/simple_openvino/1/"
    sed -e 's/^name: .*/name: "simple_openvino"/' -e 's/^platform: .*/platform: "openvino"/' \
        "$demo/simple/config.pbtxt" >"$demo/simple_openvino/config.pbtxt"
    # And a GGUF (a tiny random llama written by the tests' builder with the venv's gguf): the
    # llamacpp plugin loads llama.cpp's CPU library from inside the executable, and generates.
    llm=0
    if [[ " $expected " == *" llamacpp "* ]] && "$repo/.venv/bin/python" -c "import gguf" 2>/dev/null; then
        mkdir -p "$demo/tiny_llm/1"
        "$repo/.venv/bin/python" -c "import sys; sys.path.insert(0, sys.argv[1]); from gguf_builder import write_tiny_llama; write_tiny_llama(sys.argv[2])" \
            "$repo/tests" "$demo/tiny_llm/1/model.gguf" || fail "could not write the tiny GGUF"
        echo 'backend: "llamacpp"' >"$demo/tiny_llm/config.pbtxt"
        llm=1
    fi
    kill -HUP "$daemon_pid"
    deadline=$((SECONDS + ready_timeout))
    until [[ $(grep -c 'READY=1' "$tmp/notify.log") -ge 2 ]]; do
        ((SECONDS < deadline)) || fail "no READY=1 after SIGHUP within ${ready_timeout}s"
        sleep 0.05
    done
    grep -q 'RELOADING=1' "$tmp/notify.log" || fail "no RELOADING=1 before the reload"
    http /v2/models/simple_openvino/infer "$tmp/infer.json" >"$tmp/reply.json" || fail "infer on simple_openvino"
    "$py" "$helper" check-infer simple_openvino <"$tmp/reply.json" || fail "wrong numbers from simple_openvino"
    http /v2/models/simple_openvino >"$tmp/meta.json" || fail "GET /v2/models/simple_openvino"
    grep -q '"backend":"openvino"' "$tmp/meta.json" || fail "simple_openvino is not served by openvino: $(cat "$tmp/meta.json")"
    echo "smoke.sh: SIGHUP -> RELOADING=1 -> READY=1; simple_openvino (OpenVINO): numbers match"
    if [[ $llm == 1 ]]; then
        echo '{"model": "tiny_llm", "prompt": "hello", "max_tokens": 4, "temperature": 0}' >"$tmp/completion.json"
        http /v1/completions "$tmp/completion.json" >"$tmp/reply.json" || fail "completion on tiny_llm: $(cat "$tmp/reply.json")"
        "$py" "$helper" check-completion 4 <"$tmp/reply.json" || fail "no completion from tiny_llm"
        echo "smoke.sh: tiny_llm (llama.cpp, GGUF): generated"
    fi
    kill -TERM "$daemon_pid"
    rc=0
    wait "$daemon_pid" || rc=$?
    daemon_pid=''
    [[ $rc == 0 ]] || fail "edged exited with $rc after SIGTERM (second run)"
fi
echo "smoke.sh: OK (start->READY ${ready_s}s)"
