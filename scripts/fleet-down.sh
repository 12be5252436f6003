#!/usr/bin/env bash
# Removes what scripts/fleet-up.sh made: stops its dockerd daemons and the registry (by their pid files),
# then deletes their data roots, exec roots, registry storage and certificates. The main engine is untouched.
# Usage: sudo bash scripts/fleet-down.sh   (same ROLLWAY_FLEET_DIR as fleet-up.sh)
set -euo pipefail

DIR=${ROLLWAY_FLEET_DIR:-/var/lib/rollway-fleet}
RUN=/run/$(basename "$DIR")  # exec roots: short paths (containerd's unix sockets live there)
say() { echo "fleet-down: $*" >&2; }
[ -d "$DIR" ] || { say "nothing to remove ($DIR does not exist)"; exit 0; }

alive() {  # a process that has not ended (a zombie has: a killed daemon whose parent does not reap it)
  [ -e "/proc/$1" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}

stop_pidfile() {  # TERM, then KILL after 20 s; only the process the pid file names
  local file=$1 pid
  [ -s "$file" ] || return 0
  pid=$(cat "$file")
  alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 80); do alive "$pid" || return 0; sleep 0.25; done
  say "pid $pid ($file) did not stop; killing it"
  kill -KILL "$pid" 2>/dev/null || true
}

# the daemons stop side by side (each waits for its containers), then their containerds and mounts go
for root in "$DIR"/e*/; do
  [ -d "$root" ] && stop_pidfile "$root/dockerd.pid" &
done
wait
for root in "$DIR"/e*/; do
  [ -d "$root" ] || continue
  k=$(basename "$root")
  stop_pidfile "$RUN/$k/containerd/containerd.pid"  # left running by a SIGKILLed dockerd
  # what a killed daemon may leave mounted (its containers' overlay and shm mounts) before deleting
  awk -v a="${root%/}/" -v b="$RUN/$k/" 'index($2, a) == 1 || index($2, b) == 1 { print $2 }' /proc/mounts \
    | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  # the shims of containers a killed daemon left running (each names its containerd's address under $RUN)
  for cmd in /proc/[0-9]*/cmdline; do
    if tr '\0' ' ' 2>/dev/null < "$cmd" | grep -q -- "-address $RUN/$k/containerd/"; then
      pid=${cmd#/proc/}; kill -KILL "${pid%/cmdline}" 2>/dev/null || true
    fi
  done
  rm -rf "$RUN/$k"
  ip link del "rfl$(echo "$DIR" | md5sum | cut -c1-6)${k#e}" 2>/dev/null || true  # its bridge (fleet-up.sh)
done
stop_pidfile "$DIR/registry.pid"
rm -rf "$DIR" "$RUN"
say "removed $DIR"
