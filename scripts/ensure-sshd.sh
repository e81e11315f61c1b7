#!/usr/bin/env bash
# Make a real OpenSSH server binary available for the test suite, without
# running a system sshd: the tests start their own sshd on 127.0.0.1 with a
# private config (tests/support/sshd.py).
#
# Idempotent and fast once done: with /usr/sbin/sshd and ssh-keygen present it
# only makes sure /run/sshd exists and that no system sshd is serving port 22.
# Works unattended as root (CI=true, no stdin).
set -euo pipefail

SSHD=/usr/sbin/sshd

log() { printf 'ensure-sshd: %s\n' "$*" >&2; }

# Run a command as root (directly when we are root, as in CI).
as_root() {
    if [[ $(id -u) -eq 0 ]]; then
        "$@"
    else
        sudo -E "$@"
    fi
}

# True if process $1 exists and is not a zombie (PID 1 here may not reap).
alive() {
    local state
    state=$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null || true)
    [[ -n $state && $state != Z ]]
}

# True if the system ssh service's daemon (the one the package's init script
# or systemd unit starts, recorded in /run/sshd.pid) is running.
system_sshd_pid() {
    local pid
    [[ -r /run/sshd.pid ]] || return 1
    pid=$(cat /run/sshd.pid 2>/dev/null || true)
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    alive "$pid" || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null || true) == sshd ]] || return 1
    printf '%s\n' "$pid"
}

# True if something is listening on TCP port 22.
port22_listening() {
    if command -v ss >/dev/null 2>&1; then
        ss -Hltn 'sport = :22' 2>/dev/null | grep -q .
    else
        # /proc/net/tcp{,6}: state 0A = LISTEN, local port 0016 = 22.
        awk 'NR > 1 && $4 == "0A" && $2 ~ /:0016$/ { found = 1 } END { exit !found }' \
            /proc/net/tcp /proc/net/tcp6 2>/dev/null
    fi
}

stop_system_sshd() {
    local booted_systemd=0 pid
    [[ -d /run/systemd/system ]] && booted_systemd=1
    if (( booted_systemd )) && command -v systemctl >/dev/null 2>&1; then
        as_root systemctl disable --now ssh.service >/dev/null 2>&1 || true
        as_root systemctl disable --now ssh.socket >/dev/null 2>&1 || true
    else
        if [[ -x /etc/init.d/ssh ]]; then
            as_root /etc/init.d/ssh stop >/dev/null 2>&1 || true
        fi
        if command -v update-rc.d >/dev/null 2>&1 && [[ -e /etc/init.d/ssh ]]; then
            as_root update-rc.d ssh disable >/dev/null 2>&1 || true
        fi
    fi
    if pid=$(system_sshd_pid); then
        log "stopping system sshd (pid $pid)"
        as_root kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do
            alive "$pid" || break
            sleep 0.1
        done
    fi
}

if [[ ! -x $SSHD ]] || ! command -v ssh-keygen >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    log "installing openssh-server and openssh-client"
    # Keep the package's maintainer scripts from starting the ssh service:
    # policy-rc.d exit 101 = "action forbidden" for invoke-rc.d. Only add one
    # if the machine has none, and remove it again afterwards.
    made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' | as_root tee /usr/sbin/policy-rc.d >/dev/null
        as_root chmod 0755 /usr/sbin/policy-rc.d
        made_policy=1
        trap 'if [[ $made_policy == 1 ]]; then as_root rm -f /usr/sbin/policy-rc.d; fi' EXIT
    fi
    apt_opts=(-y -q --no-install-recommends -o DPkg::Lock::Timeout=600 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
    if ! as_root apt-get install "${apt_opts[@]}" openssh-server openssh-client </dev/null; then
        log "install failed; refreshing package lists and retrying"
        as_root apt-get update -q -o DPkg::Lock::Timeout=600 </dev/null
        as_root apt-get install "${apt_opts[@]}" openssh-server openssh-client </dev/null
    fi
    if (( made_policy )); then
        as_root rm -f /usr/sbin/policy-rc.d
        made_policy=0
    fi
    # Whatever the policy said, make sure no system sshd was left running.
    stop_system_sshd
fi

# sshd refuses to start without its privilege-separation directory; /run is
# a tmpfs on many machines, so recreate it on every call.
if [[ ! -d /run/sshd ]]; then
    as_root install -d -m 0755 -o root -g root /run/sshd
fi

if system_sshd_pid >/dev/null; then
    stop_system_sshd
fi
if system_sshd_pid >/dev/null; then
    log "error: a system sshd is still running (pid $(system_sshd_pid))"
    exit 1
fi
if port22_listening; then
    # Not necessarily ours to stop (another service, a container port); the
    # tests use their own port, so only say so.
    log "note: something other than the system sshd listens on port 22"
fi

[[ -x $SSHD ]] || { log "error: $SSHD is missing after install"; exit 1; }
command -v ssh-keygen >/dev/null 2>&1 || { log "error: ssh-keygen is missing after install"; exit 1; }
