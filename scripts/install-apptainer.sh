#!/usr/bin/env bash
# install-apptainer.sh — put a real Apptainer on a Debian bookworm machine.
#
# Usage (as root; no stdin needed; CI=true is fine):
#     bash scripts/install-apptainer.sh          # install, or fast no-op
#     HERMES_APPTAINER_FORCE=1 bash scripts/install-apptainer.sh   # reinstall
#
# Why this is not a plain `apt-get install apptainer`: bookworm has no
# apptainer package. Debian unstable has one, but its binaries need a newer
# glibc than bookworm's (GLIBC_2.38; bookworm has 2.36). So:
#
#   1. bookworm packages, installed normally: patchelf (to patch the
#      binaries), squashfs-tools (mksquashfs/unsquashfs: SIF build and
#      extraction), uidmap (newuidmap for user namespaces), plus apptainer's
#      own library deps libseccomp2 and libsqlite3-0.
#   2. `apt-get download apptainer libc6` from unstable, using a SEPARATE apt
#      state in a temp dir (own sources list, lists, cache and status). The
#      system's /etc/apt/sources.list* and /var/lib/apt are never written.
#      The mirror host is the one the system's own Debian sources name.
#   3. Both .debs unpacked with `dpkg-deb -x` under /opt/hermes-apptainer.
#   4. The two ELF binaries (usr/bin/apptainer and libexec's starter) get
#      patchelf --set-interpreter <our ld.so> and --force-rpath --set-rpath
#      <our libc dir>. DT_RPATH (not RUNPATH) on purpose: apptainer re-runs
#      itself with LD_LIBRARY_PATH=/lib/x86_64-linux-gnu (to sandbox
#      unsquashfs when it converts a SIF to a temporary sandbox); RUNPATH
#      loses to LD_LIBRARY_PATH and would load bookworm's libc, RPATH wins.
#      Only these two binaries use the new libc; everything they spawn
#      (mksquashfs, unsquashfs, newuidmap, the container's own programs)
#      uses its own normal libc.
#   5. Configuration. The Debian build has prefix /usr and sysconfdir /etc,
#      but a binary that is not at its built-in path runs "relocated": the
#      CLI looks for <tree>/usr/etc/apptainer/apptainer.conf and the starter
#      for <tree>/usr/lib/etc/apptainer/... (its prefix is three levels above
#      libexec's starter); session dirs likewise under .../var/lib/apptainer.
#      The package's own etc/apptainer is unpacked too and reached through
#      symlinks: usr/etc, usr/lib/etc -> etc; usr/var, usr/lib/var -> var.
#      It is the Debian default config but for root's capabilities (below)
#      and, where systemd is not PID 1, "systemd cgroups = no" (so that
#      --cpus/--memory work as root through the cgroupfs manager).
#      Nothing goes in /etc/apptainer, so a system apptainer, if ever
#      installed, is unaffected.
#   6. root's capability config (see DECISION below), then the symlink
#      /usr/local/bin/apptainer -> the real binary.
#   7. A smoke test (build a SIF from a tiny rootfs, exec in it, start an
#      instance and check that exec instance:// sees the image); then
#      a stamp file is written and the version printed.
#
# DECISION — no unshare in the wrapper; root runs apptainer natively.
#   /usr/local/bin/apptainer is a plain symlink to the real binary, for root
#   and non-root alike; callers need no special invocation.
#   Why: as real root, apptainer's starter by default ("root default
#   capabilities = full") requests the full capability set and refuses to
#   start where root's bounding set lacks one (here CAP_SYS_RESOURCE:
#   "Requesting capability set 0x000001ffffffffff while permitted capability
#   set is 0x000001fffeffffff"). Step 8 therefore sets "root default
#   capabilities = file" and lists in capability.json exactly the caps in
#   root's bounding set at install time. Root then works natively (SIFs are
#   loop-mounted, no extraction); root's containers are privileged, as
#   apptainer run by root always is. For a user-namespaced container as root
#   pass --userns (-u) to `instance start`/`exec`: verified to work.
#   Rejected: a wrapper doing `unshare --user --map-root-user apptainer ...`.
#   Single commands work that way, but each call gets its own user namespace,
#   and `exec instance://NAME` from another call cannot open the instance's
#   namespaces ("Could not stat ns/mnt: Permission denied" in -d output) and
#   then SILENTLY runs the command in a fresh mount namespace of the HOST
#   filesystem, exit 0: no isolation at all. Not safe to hide in a wrapper.
#   The real binary is /opt/hermes-apptainer/usr/bin/apptainer.
#
# Idempotent: if the symlink, the stamp and a working `apptainer --version`
# are there, it prints the version and exits 0 at once. If some other
# working apptainer is first on PATH it leaves it alone (exit 0), unless
# HERMES_APPTAINER_FORCE=1.
# Failure: any step that fails (no Debian mirror found, unstable has no
# apptainer, glibc too old for it, a library dep too old, patchelf or smoke
# test failing) exits non-zero with "install-apptainer: FAILED at step N
# (...)" and the reason. Nothing is downloaded except through apt from the
# Debian mirror the system already uses.
set -Eeuo pipefail
umask 022
export DEBIAN_FRONTEND=noninteractive LC_ALL=C

PREFIX=${HERMES_APPTAINER_PREFIX:-/opt/hermes-apptainer}
WRAPPER=${HERMES_APPTAINER_WRAPPER:-/usr/local/bin/apptainer}
SUITE=${HERMES_APPTAINER_SUITE:-unstable}
STAMP=$PREFIX/.hermes-apptainer-installed
REAL=$PREFIX/usr/bin/apptainer
APT_LOCK_WAIT=(-o DPkg::Lock::Timeout=600)

STEP="start"
log() { printf 'install-apptainer: %s\n' "$*" >&2; }
step() { STEP="$*"; log "step $STEP"; }
die() { log "FAILED at step $STEP: $*"; exit 1; }
trap 'rc=$?; log "FAILED at step $STEP: command \"$BASH_COMMAND\" exited $rc"; exit $rc' ERR

# --- fast path -------------------------------------------------------------
if [[ -z ${HERMES_APPTAINER_FORCE:-} ]]; then
    if [[ -f $STAMP && -x $WRAPPER ]] && v=$("$WRAPPER" --version 2>/dev/null); then
        echo "$v (already installed: $WRAPPER -> $REAL)"
        exit 0
    fi
    if other=$(command -v apptainer 2>/dev/null) && [[ $other != "$WRAPPER" ]] \
        && v=$("$other" --version 2>/dev/null); then
        echo "$v (existing apptainer at $other; not installing. HERMES_APPTAINER_FORCE=1 to install anyway)"
        exit 0
    fi
fi

# --- step 0: preconditions -------------------------------------------------
step "0 (preconditions)"
[[ $PREFIX == /?*/?* || $PREFIX == /opt/?* ]] && [[ $PREFIX != *..* ]] \
    || die "HERMES_APPTAINER_PREFIX must be an absolute path at least two levels deep, got '$PREFIX'"
[[ $(id -u) == 0 ]] || die "must run as root (it installs packages and writes $PREFIX)"
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
    || die "needs a Debian system with apt-get and dpkg-deb"
ARCH=$(dpkg --print-architecture)

# --- step 1: bookworm packages ---------------------------------------------
BOOKWORM_PKGS=(patchelf squashfs-tools uidmap libseccomp2 libsqlite3-0 libcap2-bin)
step "1 (bookworm packages: ${BOOKWORM_PKGS[*]})"
missing=()
for p in "${BOOKWORM_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get "${APT_LOCK_WAIT[@]}" update -qq >/dev/null \
        || die "apt-get update (system sources) failed"
    apt-get "${APT_LOCK_WAIT[@]}" install -y -qq --no-install-recommends "${missing[@]}" </dev/null >/dev/null \
        || die "apt-get install ${missing[*]} failed"
fi

# --- step 2: find the Debian mirror the system uses ------------------------
step "2 (find the system's Debian mirror in /etc/apt/sources.list*)"
MIRROR=${HERMES_APPTAINER_MIRROR:-}
if [[ -z $MIRROR ]]; then
    # deb822 "URIs:" lines and one-line "deb URI suite ..." lines; the
    # archive (…/debian), not the security archive (…/debian-security).
    MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
                 /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | sed -n -E -e 's/^[[:space:]]*URIs:[[:space:]]*//p' \
                    -e 's/^[[:space:]]*deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//p' \
        | tr ' ' '\n' | grep -E '^(https?|mirror\+[a-z]+)://[^[:space:]]+/debian/?$' \
        | head -n1 || true)
fi
[[ -n $MIRROR ]] || die "no Debian archive URI (…/debian) in /etc/apt/sources.list*; set HERMES_APPTAINER_MIRROR"
MIRROR=${MIRROR%/}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
[[ -r $KEYRING ]] || die "$KEYRING missing (package debian-archive-keyring)"
log "mirror $MIRROR, suite $SUITE, arch $ARCH"

# --- step 3: separate apt state, download from unstable --------------------
step "3 (apt-get update with a separate state for $SUITE)"
WORK=$(mktemp -d /var/tmp/hermes-apptainer.XXXXXX)
chmod 755 "$WORK"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"/state/lists/partial "$WORK"/cache/archives/partial "$WORK"/etc "$WORK"/dl
: >"$WORK"/state/status
echo "deb [arch=$ARCH signed-by=$KEYRING] $MIRROR $SUITE main" >"$WORK"/etc/sources.list
# _apt must be able to write where it downloads (else apt warns and runs unsandboxed)
if getent passwd _apt >/dev/null; then chown -R _apt "$WORK"/state/lists "$WORK"/cache "$WORK"/dl; fi
APTO=(-o Dir::State="$WORK"/state -o Dir::State::status="$WORK"/state/status
      -o Dir::Cache="$WORK"/cache -o Dir::Etc::SourceList="$WORK"/etc/sources.list
      -o Dir::Etc::SourceParts=/dev/null -o Dir::Etc::Preferences=/dev/null
      -o Dir::Etc::PreferencesParts=/dev/null -o APT::Default-Release=
      -o APT::Architecture="$ARCH" -o APT::Architectures="$ARCH")
apt-get "${APTO[@]}" update -qq >"$WORK"/update.log 2>&1 \
    || die "apt-get update of $MIRROR $SUITE failed: $(tail -n3 "$WORK"/update.log)$(grep -q expired "$WORK"/update.log && echo " (the mirror's $SUITE Release is past Valid-Until; this machine's apt config, like the system's, must allow that: Acquire::Check-Valid-Until \"false\")")"

step "4 (check that $SUITE has apptainer and a libc6 it can use)"
show() { apt-cache "${APTO[@]}" show --no-all-versions "$1" 2>/dev/null; }
field() { sed -n -E "s/^$1: //p" | head -n1; }
APT_INFO=$(show apptainer) || die "package apptainer not found in $MIRROR $SUITE (has it been removed from $SUITE?)"
APPTAINER_VER=$(field Version <<<"$APT_INFO")
DEPENDS=$(field Depends <<<"$APT_INFO")
LIBC_VER=$(show libc6 | field Version) || true
[[ -n $APPTAINER_VER ]] || die "no version for apptainer in $SUITE"
[[ -n $LIBC_VER ]] || die "package libc6 not found in $MIRROR $SUITE"
log "$SUITE: apptainer $APPTAINER_VER, libc6 $LIBC_VER"
# Every "pkg (>= ver)" in apptainer's Depends must be met: libc6 by the
# unstable libc6 we unpack, the other libraries by the installed bookworm ones.
while read -r dep; do
    [[ $dep =~ ^([a-z0-9.+-]+)[[:space:]]*\(([<>=]+)[[:space:]]*([^\)]+)\) ]] || continue
    pkg=${BASH_REMATCH[1]} op=${BASH_REMATCH[2]} want=${BASH_REMATCH[3]}
    case $op in '>=') dop=ge ;; '>>') dop=gt ;; '=') dop=eq ;; '<=') dop=le ;; '<<') dop=lt ;; *) continue ;; esac
    if [[ $pkg == libc6 ]]; then have=$LIBC_VER
    else have=$(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null || true)
        [[ -n $have ]] || die "apptainer $APPTAINER_VER depends on $pkg, which is not installed here (new dependency in $SUITE?)"
    fi
    dpkg --compare-versions "$have" "$dop" "$want" \
        || die "apptainer $APPTAINER_VER needs $pkg ($op $want), only $have is available (glibc/library too old for this recipe)"
done < <(tr ',' '\n' <<<"$DEPENDS" | sed 's/^ *//')

step "5 (apt-get download apptainer libc6 from $SUITE)"
(cd "$WORK"/dl && apt-get "${APTO[@]}" download -qq apptainer libc6 >"$WORK"/download.log 2>&1) \
    || die "apt-get download failed: $(tail -n3 "$WORK"/download.log)"
APPTAINER_DEB=$(ls "$WORK"/dl/apptainer_*.deb) LIBC_DEB=$(ls "$WORK"/dl/libc6_*.deb)

# --- step 6: unpack ---------------------------------------------------------
step "6 (unpack into $PREFIX)"
rm -rf "$PREFIX" "$WRAPPER"
mkdir -p "$PREFIX"
dpkg-deb -x "$APPTAINER_DEB" "$PREFIX" || die "dpkg-deb -x $APPTAINER_DEB failed"
dpkg-deb -x "$LIBC_DEB" "$PREFIX" || die "dpkg-deb -x $LIBC_DEB failed"
[[ -x $REAL ]] || die "unpacked apptainer has no usr/bin/apptainer (package layout changed)"
STARTER=$(find "$PREFIX"/usr/lib* "$PREFIX"/usr/libexec -path '*/apptainer/bin/starter' -type f 2>/dev/null | head -n1 || true)
[[ -n $STARTER ]] || die "no .../apptainer/bin/starter in the unpacked package (layout changed)"
LDSO=$(find "$PREFIX"/usr/lib "$PREFIX"/lib* -maxdepth 2 -name 'ld-linux*.so.*' \( -type f -o -type l \) 2>/dev/null | head -n1 || true)
[[ -n $LDSO ]] || die "no ld-linux*.so.* in the unpacked libc6 (layout changed)"
LIBDIR=$(dirname "$LDSO")
[[ -e $LIBDIR/libc.so.6 ]] || die "no libc.so.6 next to $LDSO (layout changed)"
[[ -f $PREFIX/etc/apptainer/apptainer.conf ]] || die "package has no etc/apptainer/apptainer.conf (layout changed)"

# --- step 7: patchelf --------------------------------------------------------
step "7 (patchelf the apptainer and starter binaries onto $LIBDIR)"
for b in "$REAL" "$STARTER"; do
    patchelf --set-interpreter "$LDSO" --force-rpath --set-rpath "$LIBDIR" "$b" \
        || die "patchelf failed on $b"
done
"$REAL" --version >/dev/null 2>"$WORK"/version.err \
    || die "patched apptainer does not run: $(head -n3 "$WORK"/version.err)"

# --- step 8: config and state dirs at the relocated paths -------------------
step "8 (config and session dirs for the relocated tree)"
STARTER_PREFIX=$(dirname "$(dirname "$(dirname "$(dirname "$STARTER")")")")
mkdir -p "$PREFIX"/var/lib/apptainer/mnt/session
for d in "$PREFIX/usr" "$STARTER_PREFIX"; do
    [[ -e $d/etc ]] || ln -s "$(realpath --relative-to="$d" "$PREFIX/etc")" "$d/etc"
    [[ -e $d/var ]] || ln -s "$(realpath --relative-to="$d" "$PREFIX/var")" "$d/var"
done
conf=$("$REAL" buildcfg 2>&1 | sed -n 's/^APPTAINER_CONF_FILE=//p')
[[ -f $conf ]] || die "apptainer expects its config at '$conf', which is missing"

step "8b (root capabilities: 'file' mode, root's bounding set)"
# capsh prints e.g. "Bounding set =cap_chown,cap_dac_override,..."; unknown
# (numbered) caps are left out.
caps=$(/usr/sbin/capsh --print | sed -n 's/^Bounding set =//p' | tr ',' '\n' \
       | grep -E '^cap_[a-z_]+$' | tr 'a-z' 'A-Z' | paste -sd, -)
[[ -n $caps ]] || die "could not read root's capability bounding set with capsh --print"
: >"$PREFIX"/etc/apptainer/capability.json
"$REAL" capability add --user root "$caps" >/dev/null 2>"$WORK"/cap.err \
    || die "apptainer capability add --user root failed: $(grep -v WARNING "$WORK"/cap.err | head -n3)"
conf_file=$PREFIX/etc/apptainer/apptainer.conf
grep -q '^root default capabilities = full$' "$conf_file" \
    || die "apptainer.conf has no 'root default capabilities = full' line (config format changed)"
sed -i 's/^root default capabilities = full$/root default capabilities = file/' "$conf_file"
# Without systemd as PID 1 the default "systemd cgroups = yes" makes every
# --cpus/--memory fail ("cannot use systemd cgroups manager, systemd not
# running as init on this host"); the cgroupfs manager works (as root).
if [[ $(cat /proc/1/comm 2>/dev/null) != systemd ]]; then
    sed -i 's/^systemd cgroups = yes$/systemd cgroups = no/' "$conf_file"
fi

# --- step 9: symlink on PATH ----------------------------------------------
step "9 (symlink $WRAPPER -> $REAL)"
mkdir -p "$(dirname "$WRAPPER")"
ln -sfn "$REAL" "$WRAPPER"

# --- step 10: smoke test ------------------------------------------------------
step "10 (smoke test: build a SIF from a tiny rootfs, exec, instance start/exec/stop)"
rootfs=$WORK/rootfs
mkdir -p "$rootfs"/bin "$rootfs"/etc
# /bin/sh is needed: without it the build silently leaves out /.singularity.d
# (startscript etc.) and `instance start` then fails.
for b in true cat bash; do
    p=$(type -P "$b") || die "$b not found on the host"
    cp -L "$p" "$rootfs/bin/$b"
    for l in $(ldd "$p" | grep -o '/[^ ]*'); do
        mkdir -p "$rootfs$(dirname "$l")"; cp -Ln "$l" "$rootfs$l"
    done
done
ln -s bash "$rootfs"/bin/sh
echo 'root:x:0:0:root:/:/bin/sh' >"$rootfs"/etc/passwd
echo hermes-smoke-marker >"$rootfs"/marker
smoke() { (cd / && HOME=$WORK "$WRAPPER" -s "$@") 2>>"$WORK"/smoke.log; }
smoke build "$WORK"/smoke.sif "$rootfs" >>"$WORK"/smoke.log \
    || die "apptainer build failed: $(tail -n5 "$WORK"/smoke.log)"
smoke exec --containall "$WORK"/smoke.sif /bin/true \
    || die "apptainer exec failed: $(tail -n5 "$WORK"/smoke.log)"
inst=hermes-smoke-$$
smoke instance start --containall --no-home --writable-tmpfs "$WORK"/smoke.sif "$inst" \
    || die "apptainer instance start failed: $(tail -n5 "$WORK"/smoke.log)"
out=$(smoke exec --pwd / "instance://$inst" /bin/cat /marker || true)
smoke instance stop "$inst" || true
[[ $out == hermes-smoke-marker ]] \
    || die "exec instance:// did not run inside the instance (got '$out'): $(tail -n5 "$WORK"/smoke.log)"

printf 'apptainer %s\nlibc6 %s\nmirror %s %s\n' "$APPTAINER_VER" "$LIBC_VER" "$MIRROR" "$SUITE" >"$STAMP"
STEP=done
echo "$("$WRAPPER" --version) (installed: $WRAPPER -> $REAL; Debian $SUITE apptainer $APPTAINER_VER on libc6 $LIBC_VER)"
