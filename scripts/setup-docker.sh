#!/usr/bin/env bash
# Idempotent: a running Docker engine and rollway's sandbox base image, built offline from Debian packages.
#   1. installs Debian's docker.io, debootstrap, docker-compose (and openssl, docker-registry and curl for
#      scripts/fleet-up.sh) when missing (as root);
#   2. starts dockerd when no engine answers (log: $ROLLWAY_DOCKERD_LOG), waits until `docker info` works;
#   3. builds the base image ($ROLLWAY_SANDBOX_IMAGE, default rollway-sandbox:bookworm) once:
#      debootstrap --variant=minbase (python3, git, bash, coreutils, patch, pip, venv) -> tarball cached
#      in ~/.cache/rollway -> `docker import`. No registry is contacted: docker pull does not work here.
# Usage: bash scripts/setup-docker.sh [--engine-only]
set -euo pipefail

IMAGE=${ROLLWAY_SANDBOX_IMAGE:-rollway-sandbox:bookworm}
CACHE=${ROLLWAY_CACHE:-$HOME/.cache/rollway}
LOG=${ROLLWAY_DOCKERD_LOG:-/var/log/rollway-dockerd.log}
SUITE=bookworm
# python-is-python3 and pytest: SWE tasks are graded with `python -m pytest` in the sandbox.
PACKAGES=python3,python-is-python3,python3-pip,python3-venv,python3-pytest,git,bash,coreutils,patch,procps,ca-certificates
RECIPE=$(echo "$SUITE $PACKAGES" | md5sum | cut -c1-8)
TARBALL="$CACHE/sandbox-$SUITE-$RECIPE.tar"
is_root() { [ "$(id -u)" = 0 ]; }
say() { echo "setup-docker: $*" >&2; }

engine_answers() { docker info >/dev/null 2>&1; }

install_packages() {
  local need=()
  command -v dockerd >/dev/null || need+=(docker.io)
  command -v debootstrap >/dev/null || need+=(debootstrap)
  command -v docker-compose >/dev/null || need+=(docker-compose)
  # scripts/fleet-up.sh (the fleet tests): certificates and the image registry
  command -v openssl >/dev/null || need+=(openssl)
  command -v docker-registry >/dev/null || need+=(docker-registry)
  command -v curl >/dev/null || need+=(curl)
  [ ${#need[@]} -eq 0 ] && return 0
  if ! is_root; then
    say "please install ${need[*]} as root: sudo apt-get install -y ${need[*]}"
    exit 1
  fi
  say "installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 "${need[@]}" >/dev/null
}

start_engine() {
  engine_answers && return 0
  if ! is_root; then
    say "no Docker engine answers and only root can start one: run 'sudo bash scripts/setup-docker.sh'," \
        "or 'sudo dockerd &', or point DOCKER_HOST at a running engine"
    exit 1
  fi
  if [ -S /var/run/docker.sock ] && ! pgrep -x dockerd >/dev/null; then
    rm -f /var/run/docker.sock  # stale socket of a dead daemon
  fi
  if ! pgrep -x dockerd >/dev/null; then
    say "starting dockerd (log: $LOG)"
    mkdir -p "$(dirname "$LOG")"
    # setsid + nohup: the daemon outlives this script and the make/pytest process that ran it.
    setsid nohup dockerd >>"$LOG" 2>&1 </dev/null &
  fi
  for _ in $(seq 1 120); do
    engine_answers && { say "engine ready ($(docker info --format '{{.ServerVersion}} {{.Driver}}'))"; return 0; }
    sleep 0.5
  done
  say "dockerd did not answer within 60 s; its log ($LOG) ends with:"
  tail -20 "$LOG" >&2 || true
  exit 1
}

# The Debian archive debootstrap reads from: ROLLWAY_DEBIAN_MIRROR, else the first archive this machine's
# own apt sources list for $SUITE (deb822 .sources stanzas or one-line .list entries). No address is
# written here: the machine's configuration decides where packages come from.
apt_mirror() {
  if [ -n "${ROLLWAY_DEBIAN_MIRROR:-}" ]; then echo "$ROLLWAY_DEBIAN_MIRROR"; return 0; fi
  local f uri
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    uri=$(awk -v suite="$SUITE" -v deb822="$([[ $f == *.sources ]] && echo 1)" '
      function stanza_end() { if (uri != "" && has) { print uri; found = 1; exit } uri = ""; has = 0 }
      deb822 && /^[[:space:]]*$/ { stanza_end(); next }
      deb822 && $1 == "URIs:" { uri = $2 }
      deb822 && $1 == "Suites:" { for (i = 2; i <= NF; i++) if ($i == suite) has = 1 }
      !deb822 && $1 == "deb" {
        i = 2; if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
        if ($(i + 1) == suite) { print $i; found = 1; exit }
      }
      END { if (deb822 && !found) stanza_end() }
    ' "$f")
    if [ -n "$uri" ]; then echo "$uri"; return 0; fi
  done
  return 1
}

build_base_image() {
  # Rebuilt when the package list changed (the image carries the recipe's hash as a label).
  if [ "$(docker image inspect -f '{{index .Config.Labels "rollway.recipe"}}' "$IMAGE" 2>/dev/null)" = "$RECIPE" ]; then
    return 0
  fi
  mkdir -p "$CACHE"
  if [ ! -s "$TARBALL" ]; then
    local root mirror
    if ! mirror=$(apt_mirror); then
      say "no apt source on this machine lists Debian $SUITE; set ROLLWAY_DEBIAN_MIRROR to a Debian archive URL"
      exit 1
    fi
    root=$(mktemp -d /var/tmp/rollway-debootstrap.XXXXXX)
    say "debootstrap $SUITE ($PACKAGES) from $mirror into $root"
    if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$mirror" \
        >"$CACHE/debootstrap.log" 2>&1; then
      say "debootstrap failed; the end of $CACHE/debootstrap.log:"
      tail -20 "$CACHE/debootstrap.log" >&2
      rm -rf "$root"
      exit 1
    fi
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar --numeric-owner -C "$root" -cf "$TARBALL.part" .
    mv "$TARBALL.part" "$TARBALL"
    find "$CACHE" -maxdepth 1 -name "sandbox-$SUITE-*.tar" ! -name "$(basename "$TARBALL")" -delete
    rm -rf "$root"
  fi
  say "importing $TARBALL as $IMAGE"
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["bash"]' \
    --change "LABEL rollway.recipe=$RECIPE" \
    "$TARBALL" "$IMAGE" >/dev/null
}

# compose builds the rollway image with pip reaching PyPI; a host behind a TLS-intercepting proxy
# trusts its CA through the system bundle, which the build then needs too (git-ignored .build/).
copy_ca_bundle() {
  local repo
  repo="$(cd "$(dirname "$0")/.." && pwd)"
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    mkdir -p "$repo/.build" && cp /etc/ssl/certs/ca-certificates.crt "$repo/.build/ca-certificates.crt"
  fi
}

install_packages
start_engine
copy_ca_bundle
[ "${1:-}" = "--engine-only" ] || build_base_image
say "ready: engine $(docker info --format '{{.ServerVersion}}'), image $IMAGE"
