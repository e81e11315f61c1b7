#!/usr/bin/env bash
# Make sure a real Docker engine answers on the default socket.
#
#   scripts/ensure-docker.sh
#
# Idempotent and fast when the engine already answers. Otherwise it installs
# Debian's docker.io if dockerd is missing, starts dockerd detached (it
# survives this script) with no bridge network and no iptables changes, waits
# for it, and prints the storage driver. Meant for root on Debian (a developer
# machine or CI with CI=true and no stdin). Exit status is non-zero, with the
# daemon log tail on stderr, when the engine cannot be brought up.
#
# Environment:
#   HERMES_DOCKERD_LOG      daemon log (default /var/log/hermes-dockerd.log)
#   HERMES_DOCKERD_TIMEOUT  seconds to wait for the daemon (default 30)
set -euo pipefail

LOG=${HERMES_DOCKERD_LOG:-/var/log/hermes-dockerd.log}
TIMEOUT=${HERMES_DOCKERD_TIMEOUT:-30}
LOCK=/run/hermes-ensure-docker.lock

log() { printf 'ensure-docker: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

engine_up() { docker info >/dev/null 2>&1; }

report() {
    local driver
    driver=$(docker info --format '{{.Driver}}' 2>/dev/null || true)
    echo "docker engine ready: server $(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'), storage driver ${driver:-?}, cgroup $(docker info --format '{{.CgroupVersion}}' 2>/dev/null || echo '?')"
    if [[ "$driver" != "overlay2" ]]; then
        log "WARNING: storage driver is '${driver}', not overlay2 (containers will be slower to create)"
    fi
}

# Fast path: nothing to do. The docker client may be installed alone, so
# check it exists before asking it anything.
if command -v docker >/dev/null 2>&1 && engine_up; then
    report
    exit 0
fi

[[ $(id -u) -eq 0 ]] || die "must run as root to install or start dockerd (uid $(id -u))"

# Serialise concurrent callers (e.g. parallel test workers).
exec 9>"$LOCK"
flock -w $((TIMEOUT + 120)) 9 || die "could not take $LOCK"

# Another caller may have brought it up while we waited for the lock.
if command -v docker >/dev/null 2>&1 && engine_up; then
    report
    exit 0
fi

install_docker() {
    export DEBIAN_FRONTEND=noninteractive
    local apt_opts=(-y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
    # Only refresh the lists when apt does not know a candidate for docker.io.
    local candidate
    candidate=$(apt-cache policy docker.io 2>/dev/null | awk '/Candidate:/ {print $2}')
    if [[ -z "$candidate" || "$candidate" == "(none)" ]]; then
        log "apt-get update (no candidate for docker.io yet)"
        apt-get update -q </dev/null
    fi
    log "apt-get install docker.io"
    if ! apt-get install "${apt_opts[@]}" docker.io </dev/null; then
        # Stale lists (a version that vanished from the mirror): refresh once.
        log "install failed; apt-get update and retry"
        apt-get update -q </dev/null
        apt-get install "${apt_opts[@]}" docker.io </dev/null
    fi
}

if ! command -v dockerd >/dev/null 2>&1; then
    install_docker
fi
command -v dockerd >/dev/null 2>&1 || die "dockerd still missing after installing docker.io"
command -v docker >/dev/null 2>&1 || die "docker client missing"

# The package's postinst may have started the daemon (on machines with systemd).
if engine_up; then
    report
    exit 0
fi

# A killed daemon can linger as a zombie (PID 1 here does not always reap):
# it must count as gone, for pgrep and for the pid file alike.
alive() {  # pid
    local s
    [[ -r /proc/$1/stat ]] || return 1
    IFS= read -r s </proc/"$1"/stat 2>/dev/null || return 1
    s=${s##*) }
    [[ ${s%% *} != Z ]]
}
live_dockerd() {
    local p
    for p in $(pgrep -x dockerd 2>/dev/null); do alive "$p" && return 0; done
    return 1
}
starts=0
start_dockerd() {
    local args=(--bridge=none --iptables=false --ip-masq=false)
    if dockerd --help 2>&1 | grep -q -- '--ip6tables'; then
        args+=(--ip6tables=false)
    fi
    mkdir -p "$(dirname "$LOG")"
    # A pid file left by a daemon that died would block the new one.
    if [[ -f /var/run/docker.pid ]] && ! alive "$(cat /var/run/docker.pid 2>/dev/null)"; then
        rm -f /var/run/docker.pid
    fi
    starts=$((starts + 1))
    log "starting dockerd ${args[*]} (log: $LOG)"
    printf '\n==== %s ensure-docker: dockerd %s\n' "$(date -Is)" "${args[*]}" >>"$LOG"
    # New session, no controlling terminal, stdin closed, lock fd not inherited:
    # the daemon outlives this script and the shell that ran it.
    setsid nohup dockerd "${args[@]}" </dev/null >>"$LOG" 2>&1 9>&- &
    disown || true
}

if live_dockerd; then
    log "dockerd is running (pid $(pgrep -x dockerd | tr '\n' ' ')) but not answering yet; waiting"
else
    start_dockerd
fi

# Poll at short intervals, bounded by TIMEOUT seconds.
deadline=$(( $(date +%s) + TIMEOUT ))
until engine_up; do
    if (( $(date +%s) >= deadline )); then
        log "dockerd did not answer within ${TIMEOUT}s; last lines of $LOG:"
        tail -n 40 "$LOG" >&2 || true
        exit 1
    fi
    if ! live_dockerd; then
        sleep 0.5
        engine_up && break
        if (( starts < 2 )); then
            # The one we waited for was dying (or ours failed once): one more start.
            start_dockerd
            continue
        fi
        log "dockerd exited; last lines of $LOG:"
        tail -n 40 "$LOG" >&2 || true
        exit 1
    fi
    sleep 0.2
done

report
