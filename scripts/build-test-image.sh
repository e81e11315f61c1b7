#!/usr/bin/env bash
# Build the small image the Docker backend tests run in, without any network.
#
#   scripts/build-test-image.sh [TAG]        (default TAG: hermes-env-test:latest)
#
# The root filesystem is assembled from THIS host's binaries (bash, dash,
# coreutils, procps, findutils, grep, sed, awk, tar, gzip, which, hostname,
# a few util-linux tools ...) plus the shared libraries ldd reports for them,
# laid out with the host's usrmerge symlinks (bin -> usr/bin ...), and fed to
# `docker import`. Users: root (0) and agent (1000, /home/agent, /bin/bash).
#
# The image carries the label hermes-env.test-image=<content hash>, a sha256
# over every file's path, type, mode, owner and content plus the image config
# below. When an image with that label exists already, nothing is rebuilt: the
# tag is (re)pointed at it. The engine is brought up first with
# ensure-docker.sh. The last line of stdout is the tag.
set -euo pipefail

TAG=${1:-hermes-env-test:latest}
LABEL_KEY=hermes-env.test-image
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Image config; part of the content hash.
CHANGES=(
    'CMD ["/bin/bash"]'
    'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
    'ENV LANG=C.UTF-8'
)
LAYOUT_VERSION=1   # bump when the layout logic changes in a way files don't show

log() { printf 'build-test-image: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

start=$(date +%s.%N)

"$HERE/ensure-docker.sh" >&2

# One builder at a time (parallel test workers share the engine).
exec 9>/run/hermes-build-test-image.lock
flock -w 600 9 || die "could not take the build lock"

# ---------------------------------------------------------------- file list
# Commands that must be in the image, by name (looked up on the host PATH).
REQUIRED_CMDS=(bash sh dash ps pkill pgrep kill find xargs grep sed awk tar gzip
               gunzip zcat which hostname)
# Nice to have; reported when missing.
OPTIONAL_CMDS=(setsid nsenter flock getent diff cmp mawk gawk xz pidof egrep fgrep script)
# Whole packages whose bin/ and sbin/ entries all go in.
PACKAGES=(coreutils)

host_paths=()
missing_optional=()

for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W "$pkg" >/dev/null 2>&1 || die "host package $pkg is not installed"
    while IFS= read -r p; do
        [[ -f "$p" || -L "$p" ]] && host_paths+=("$p")
    done < <(dpkg -L "$pkg" | grep -E '/s?bin/[^/]+$')
done
for c in "${REQUIRED_CMDS[@]}"; do
    # type -P: the file on PATH, not a shell builtin (kill); no /usr/local.
    p=$(PATH=/usr/sbin:/usr/bin:/sbin:/bin type -P "$c") \
        || die "required command '$c' not found on the host"
    host_paths+=("$p")
done
for c in "${OPTIONAL_CMDS[@]}"; do
    if p=$(PATH=/usr/sbin:/usr/bin:/sbin:/bin type -P "$c"); then
        host_paths+=("$p")
    else
        missing_optional+=("$c")
    fi
done
# usr/bin/env must exist (shebangs); coreutils ships it, be explicit anyway.
host_paths+=(/usr/bin/env)
# The C.UTF-8 locale (glibc >= 2.35 ships it as files) so LANG=C.UTF-8 works.
if [[ -d /usr/lib/locale/C.utf8 ]]; then
    while IFS= read -r p; do host_paths+=("$p"); done < <(find /usr/lib/locale/C.utf8 -type f)
fi

# Shared libraries and the dynamic loader, in one ldd call over every ELF.
elves=()
for p in "${host_paths[@]}"; do
    magic=
    LC_ALL=C read -r -N 4 magic <"$p" 2>/dev/null || true
    [[ "$magic" == $'\x7fELF' ]] && elves+=("$p")
done
while IFS= read -r lib; do
    host_paths+=("$lib")
done < <(ldd "${elves[@]}" 2>/dev/null | awk '
    $2 == "=>" && $3 ~ /^\// { print $3 }
    $1 ~ /^\// && $2 ~ /^\(0x/ { print $1 }' | sort -u)
# glibc may dlopen these at run time (NSS lookups, pthread_cancel unwinding).
for lib in /lib/x86_64-linux-gnu/libnss_files.so.2 /lib/x86_64-linux-gnu/libgcc_s.so.1; do
    [[ -e "$lib" ]] && host_paths+=("$lib")
done

# ---------------------------------------------------------------- staging
work=$(mktemp -d /tmp/hermes-test-image.XXXXXX)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
mkdir -p "$root/usr"

# The host's usrmerge layout: top-level dirs that are symlinks stay symlinks.
for d in bin sbin lib lib32 lib64 libx32; do
    if [[ -L "/$d" ]]; then
        target=$(readlink "/$d")
        mkdir -p "$root/$(dirname "$d")/$target"
        ln -s "$target" "$root/$d"
    elif [[ -d "/$d" ]]; then
        mkdir -p "$root/$d"
    fi
done

declare -A seen=() realdir=() copies=()
# add_path HOSTPATH: put it at the same canonical place in the rootfs. A
# symlink to a name in the same directory stays a symlink (and its target is
# added); any other symlink (e.g. /etc/alternatives) is copied dereferenced.
# Copies are batched per directory (one cp each) to keep this fast.
add_path() {
    local p=$1 dir name target
    dir=${p%/*}; dir=${dir:-/}; name=${p##*/}
    if [[ -z "${realdir[$dir]:-}" ]]; then
        realdir[$dir]=$(realpath -e "$dir") || return 1
        mkdir -p "$root${realdir[$dir]}"
    fi
    dir=${realdir[$dir]}
    [[ -n "${seen[$dir/$name]:-}" ]] && return 0
    seen[$dir/$name]=1
    if [[ -L "$p" ]]; then
        target=$(readlink "$p")
        if [[ "$target" != */* ]]; then
            ln -sfn "$target" "$root$dir/$name"
            add_path "$dir/$target"
            return
        fi
    fi
    [[ -e "$p" ]] || return 1
    copies[$dir]+="$p"$'\n'
}
for p in "${host_paths[@]}"; do
    add_path "$p" || die "cannot add $p"
done
for dir in "${!copies[@]}"; do
    mapfile -t files < <(printf '%s' "${copies[$dir]}")
    # Same basename from two host dirs merged by usrmerge: last one wins, fine.
    cp -L --preserve=mode -t "$root$dir" "${files[@]}"
done

# Directories and config files.
install -d -m 0755 "$root"/{etc,proc,sys,dev,run,home,var,usr/local/bin,usr/sbin,usr/bin,usr/lib}
install -d -m 1777 "$root/tmp" "$root/var/tmp"
install -d -m 0700 "$root/root"
install -d -m 0755 -o 1000 -g 1000 "$root/home/agent"
cat >"$root/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/bash
agent:x:1000:1000:agent:/home/agent:/bin/bash
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
cat >"$root/etc/group" <<'EOF'
root:x:0:
agent:x:1000:
nogroup:x:65534:
EOF
cat >"$root/etc/nsswitch.conf" <<'EOF'
passwd:   files
group:    files
shadow:   files
hosts:    files
networks: files
EOF
# shellcheck source=/dev/null
printf 'hermes-env test image (rootfs from the host: %s)\n' \
    "$(. /etc/os-release && echo "$PRETTY_NAME")" >"$root/etc/hermes-env-test-image"
chmod 0644 "$root"/etc/{passwd,group,nsswitch.conf,hermes-env-test-image}

# ---------------------------------------------------------------- hash
hash=$(
    cd "$root"
    {
        echo "layout $LAYOUT_VERSION"
        printf 'change %s\n' "${CHANGES[@]}"
        find . -printf '%y %m %U %G %p -> %l\n' | LC_ALL=C sort
        find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    } | sha256sum | cut -c1-32
)

# Only an image of this repository (or untagged): a commit of a test container (a snapshot)
# carries the same label and must never become the test image.
existing=$(docker images --filter "label=$LABEL_KEY=$hash" --format '{{.ID}} {{.Repository}}' \
    | awk -v r="${TAG%%:*}" '$2 == r || $2 == "<none>" {print $1; exit}')
if [[ -n "$existing" ]]; then
    docker tag "$existing" "$TAG"
    action="up to date (content hash $hash), not rebuilt"
else
    old=$(docker images --filter "label=$LABEL_KEY" --format '{{.ID}}' | sort -u)
    change_args=()
    for c in "${CHANGES[@]}"; do change_args+=(--change "$c"); done
    change_args+=(--change "LABEL $LABEL_KEY=$hash")
    tar -C "$root" --sort=name --mtime=@0 --numeric-owner -cf - . \
        | docker import "${change_args[@]}" --message "hermes-env test image $hash" - "$TAG" >/dev/null
    action="built (content hash $hash)"
    # Drop earlier builds that no tag points at any more (ignore ones in use).
    for id in $old; do
        if [[ -z "$(docker image inspect -f '{{join .RepoTags ","}}' "$id" 2>/dev/null)" ]]; then
            docker rmi "$id" >/dev/null 2>&1 || true
        fi
    done
fi

size=$(docker image inspect -f '{{.Size}}' "$TAG")
end=$(date +%s.%N)
if ((${#missing_optional[@]})); then
    log "optional commands not on the host, left out: ${missing_optional[*]}"
fi
printf 'image %s %s; %d files; size %s bytes (%.1f MiB); took %.2f s\n' \
    "$TAG" "$action" "${#seen[@]}" "$size" "$(awk -v s="$size" 'BEGIN{print s/1048576}')" \
    "$(awk -v a="$start" -v b="$end" 'BEGIN{print b-a}')"
echo "$TAG"
