#!/usr/bin/env bash
# A fleet of Docker engines on this machine, for tests and for trying a multi-host setup on one host:
#   N extra dockerd daemons (each its own data root, exec root, pid file, log), each listening with TLS
#   (client certificates required) on a loopback port and on a unix socket ($RUN/eK/docker.sock, what an
#   ssh:// endpoint forwards), plus an image registry (Debian's docker-registry)
#   holding the sandbox base image, which every engine pulls. Certificates are made here with openssl.
# Prints the fleet's settings as `rollway` overrides, one per line (also written to $DIR/fleet.args, and
# as a `sandbox:` YAML section to $DIR/fleet.yaml):
#   mapfile -t FLEET < <(sudo bash scripts/fleet-up.sh 3); rollway up CONFIG sandbox.type=docker "${FLEET[@]}"
# Idempotent: engines already answering are kept. Remove everything with scripts/fleet-down.sh.
# Settings (environment): ROLLWAY_FLEET_DIR (default /var/lib/rollway-fleet), ROLLWAY_FLEET_PORT (first
# engine's port - 1, default 23760), ROLLWAY_REGISTRY_PORT (23750), ROLLWAY_FLEET_CAPACITY (sandboxes per
# engine, 8), ROLLWAY_SANDBOX_IMAGE (rollway-sandbox:bookworm; built by scripts/setup-docker.sh),
# ROLLWAY_REGISTRY_DIR (the registry's storage, default $DIR/registry; one outside $DIR outlives
# fleet-down.sh, so a later fleet pushes only what changed).
set -euo pipefail

N=${1:?usage: fleet-up.sh N (number of engines)}
DIR=${ROLLWAY_FLEET_DIR:-/var/lib/rollway-fleet}
RUN=/run/$(basename "$DIR")  # exec roots: short paths (containerd's unix sockets live there)
BASE_PORT=${ROLLWAY_FLEET_PORT:-23760}
REG_PORT=${ROLLWAY_REGISTRY_PORT:-23750}
CAPACITY=${ROLLWAY_FLEET_CAPACITY:-8}
IMAGE=${ROLLWAY_SANDBOX_IMAGE:-rollway-sandbox:bookworm}
REGISTRY=127.0.0.1:$REG_PORT
STORE=${ROLLWAY_REGISTRY_DIR:-$DIR/registry}
CERTS=$DIR/certs
say() { echo "fleet-up: $*" >&2; }

[ "$(id -u)" = 0 ] || { say "run as root (it starts Docker daemons): sudo bash $0 $N"; exit 1; }
need=()
command -v openssl >/dev/null || need+=(openssl)
command -v docker-registry >/dev/null || need+=(docker-registry)
command -v dockerd >/dev/null || need+=(docker.io)
if [ ${#need[@]} -gt 0 ]; then
  say "installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 "${need[@]}" >/dev/null
fi
docker info >/dev/null 2>&1 || bash "$(dirname "$0")/setup-docker.sh" >&2  # the main engine holds the image
docker image inspect "$IMAGE" >/dev/null 2>&1 || bash "$(dirname "$0")/setup-docker.sh" >&2
mkdir -p "$DIR" "$CERTS"
chmod 0700 "$CERTS"

# ---- certificates: a CA, one server certificate for 127.0.0.1 (every engine), one client certificate.
make_certs() {
  [ -s "$CERTS/client-key.pem" ] && return 0
  say "making certificates in $CERTS"
  (
    cd "$CERTS"
    umask 077
    openssl genrsa -out ca-key.pem 2048 2>/dev/null
    openssl req -new -x509 -days 30 -key ca-key.pem -subj "/CN=rollway fleet CA" -out ca.pem
    openssl genrsa -out server-key.pem 2048 2>/dev/null
    openssl req -new -key server-key.pem -subj "/CN=127.0.0.1" -out server.csr
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' > server.ext
    openssl x509 -req -days 30 -in server.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -extfile server.ext \
      -out server.pem 2>/dev/null
    openssl genrsa -out client-key.pem 2048 2>/dev/null
    openssl req -new -key client-key.pem -subj "/CN=rollway client" -out client.csr
    printf 'extendedKeyUsage=clientAuth\n' > client.ext
    openssl x509 -req -days 30 -in client.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -extfile client.ext \
      -out client.pem 2>/dev/null
    rm -f ./*.csr ./*.ext
    chmod 0644 ca.pem server.pem client.pem
  )
}

# ---- the registry (plain HTTP on loopback: Docker trusts 127.0.0.0/8 registries without TLS by default).
start_registry() {
  if curl -fsS "http://$REGISTRY/v2/" >/dev/null 2>&1; then return 0; fi
  mkdir -p "$STORE"
  cat > "$DIR/registry.yml" <<EOF
version: 0.1
storage:
  filesystem:
    rootdirectory: $STORE
  delete:
    enabled: true
http:
  addr: $REGISTRY
EOF
  say "starting the image registry on $REGISTRY"
  setsid nohup docker-registry serve "$DIR/registry.yml" >>"$DIR/registry.log" 2>&1 </dev/null &
  echo $! > "$DIR/registry.pid"
  for _ in $(seq 1 100); do curl -fsS "http://$REGISTRY/v2/" >/dev/null 2>&1 && return 0; sleep 0.2; done
  say "the registry did not answer; $DIR/registry.log ends with:"; tail -5 "$DIR/registry.log" >&2; exit 1
}

image_id() {  # the main engine's image id: the digest of its config, which a pull keeps
  docker image inspect --format '{{.Id}}' "$IMAGE"
}

push_image() {
  # Pushed once: the registry keeps the layers, every engine pulls them (docs/deployment.md, "Images"). The
  # tag alone is not enough: an image rebuilt since (scripts/setup-docker.sh) would leave the old one there.
  local held
  held=$(curl -fsS "http://$REGISTRY/v2/${IMAGE%%:*}/manifests/${IMAGE##*:}" \
      -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' 2>/dev/null \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["config"]["digest"])' 2>/dev/null || true)
  [ "$held" = "$(image_id)" ] && return 0
  say "pushing $IMAGE to $REGISTRY"
  docker tag "$IMAGE" "$REGISTRY/$IMAGE"
  docker push "$REGISTRY/$IMAGE" >/dev/null
  docker rmi "$REGISTRY/$IMAGE" >/dev/null
}

engine_cli() {  # docker CLI of engine $1 (over its TLS port, as any remote client would)
  local port=$((BASE_PORT + $1)); shift
  docker --tlsverify --tlscacert "$CERTS/ca.pem" --tlscert "$CERTS/client.pem" --tlskey "$CERTS/client-key.pem" \
    -H "tcp://127.0.0.1:$port" "$@"
}

bridge_of() { echo "rfl$(echo "$DIR" | md5sum | cut -c1-6)$1"; }  # an interface name: at most 15 characters

start_engine() {
  local k=$1 port=$((BASE_PORT + $1)) root="$DIR/e$1"
  if engine_cli "$k" info >/dev/null 2>&1; then return 0; fi
  mkdir -p "$root/data" "$RUN/e$k"
  # A killed daemon's pid file: dockerd refuses to start while it names a live process, and a killed daemon
  # whose parent is a pid 1 that does not reap stays a zombie. Only a running dockerd keeps it.
  local old
  old=$(cat "$root/dockerd.pid" 2>/dev/null || true)
  if [ -n "$old" ] && { [ "$(cat "/proc/$old/comm" 2>/dev/null)" != dockerd ] ||
       [ "$(awk '{print $3}' "/proc/$old/stat" 2>/dev/null)" = Z ]; }; then
    rm -f "$root/dockerd.pid"
  fi
  # ... and the containerd it started, still running: the new daemon's own would time out on its socket.
  old=$(cat "$RUN/e$k/containerd/containerd.pid" 2>/dev/null || true)
  if [ -n "$old" ] && [ "$(cat "/proc/$old/comm" 2>/dev/null)" = containerd ]; then
    kill -KILL "$old" 2>/dev/null || true
    for _ in $(seq 1 40); do
      [ "$(awk '{print $3}' "/proc/$old/stat" 2>/dev/null || echo Z)" = Z ] && break; sleep 0.25
    done
  fi
  rm -f "$RUN/e$k/containerd/containerd.pid"  # a zombie would still count as running
  say "starting engine fleet-$k on 127.0.0.1:$port (data root $root/data)"
  # Its own bridge, no iptables rules: sandboxes have no network, and the main engine owns docker0 and NAT.
  # (Not --bridge=none: a daemon started so deletes the host's docker0, the main engine's bridge.)
  local br
  br=$(bridge_of "$k")
  if ! ip link show "$br" >/dev/null 2>&1; then
    ip link add "$br" type bridge
    ip addr add "10.$((200 + 0x$(echo "$DIR" | md5sum | cut -c1-2) % 50)).$k.1/24" dev "$br"
    ip link set "$br" up
  fi
  setsid nohup dockerd --data-root "$root/data" --exec-root "$RUN/e$k" --pidfile "$root/dockerd.pid" \
    -H "tcp://127.0.0.1:$port" -H "unix://$RUN/e$k/docker.sock" --tlsverify --tlscacert "$CERTS/ca.pem" \
    --tlscert "$CERTS/server.pem" \
    --tlskey "$CERTS/server-key.pem" --bridge="$br" --iptables=false --ip-masq=false \
    >>"$root/dockerd.log" 2>&1 </dev/null &
}

wait_engine() {
  local k=$1
  for _ in $(seq 1 240); do engine_cli "$k" info >/dev/null 2>&1 && return 0; sleep 0.25; done
  say "engine fleet-$k did not answer within 60 s; $DIR/e$k/dockerd.log ends with:"
  tail -20 "$DIR/e$k/dockerd.log" >&2; exit 1
}

load_image() {  # the engine's image must be the main engine's, not only carry its tag
  local k=$1
  [ "$(engine_cli "$k" image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null)" = "$(image_id)" ] && return 0
  engine_cli "$k" pull -q "$REGISTRY/$IMAGE" >/dev/null
  engine_cli "$k" tag "$REGISTRY/$IMAGE" "$IMAGE"
}

make_certs
start_registry
push_image
for k in $(seq 1 "$N"); do start_engine "$k"; done
for k in $(seq 1 "$N"); do wait_engine "$k"; done
pids=()
for k in $(seq 1 "$N"); do load_image "$k" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done
echo "$N" > "$DIR/engines"

engines=""
yaml="sandbox:\n  type: docker\n  image_registry: $REGISTRY\n  engines:\n"
for k in $(seq 1 "$N"); do
  e="{\"id\":\"fleet-$k\",\"endpoint\":\"tcp://127.0.0.1:$((BASE_PORT + k))\",\"tls_ca\":\"$CERTS/ca.pem\",\"tls_cert\":\"$CERTS/client.pem\",\"tls_key\":\"$CERTS/client-key.pem\",\"capacity\":$CAPACITY}"
  engines="$engines${engines:+,}$e"
  yaml="$yaml    - $e\n"
done
printf '%s\n' "sandbox.engines=[$engines]" "sandbox.image_registry=$REGISTRY" | tee "$DIR/fleet.args"
printf "$yaml" > "$DIR/fleet.yaml"
say "ready: $N engines, registry $REGISTRY; settings in $DIR/fleet.args and $DIR/fleet.yaml"
