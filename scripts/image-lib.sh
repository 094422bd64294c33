# Shared by scripts/check-image (buildah) and scripts/docker-image (a Docker engine):
# the debootstrap base, pip's settings as build arguments, timed steps, the short run.
# Source it after setting PROG (the script's name, for messages); it sets IMAGE, BASE,
# CACHE, MIRROR and LOG from the environment or their defaults.
# shellcheck shell=bash

IMAGE=${IMAGE:-localhost/diloco-flows:latest}
BASE=localhost/diloco-base:bookworm
CACHE=${DILOCO_IMAGE_CACHE:-/var/tmp/diloco-image}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
LOG="$CACHE/logs"

die() { echo "$PROG: $*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# step NAME COMMAND...: runs it with its output in $LOG/NAME.log; ok + time, or the
# log's tail and exit 1.
step() {
  local name=$1 t0; shift
  t0=$(now)
  if "$@" >"$LOG/$name.log" 2>&1; then
    printf 'ok    %-34s %7ss\n' "$name" "$(since "$t0")"
  else
    printf 'FAIL  %-34s %7ss   (log: %s)\n' "$name" "$(since "$t0")" "$LOG/$name.log"
    tail -n 40 "$LOG/$name.log" | sed 's/^/      /'
    exit 1
  fi
}

# The base: Debian bookworm (python3 3.11 and its venv module) by debootstrap, in
# $CACHE/rootfs, made once; each builder commits it as $BASE in its own storage.
make_rootfs() {
  rm -rf "$CACHE/rootfs.tmp"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$CACHE/rootfs.tmp" "$MIRROR"
  rm -rf "$CACHE/rootfs.tmp"/var/cache/apt/archives/*.deb "$CACHE/rootfs.tmp"/var/lib/apt/lists/*
  mv "$CACHE/rootfs.tmp" "$CACHE/rootfs"
}
ensure_rootfs() {
  mkdir -p "$LOG"
  if ! command -v debootstrap >/dev/null; then
    install_debootstrap() {
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
    }
    step install-debootstrap install_debootstrap
  fi
  [ -d "$CACHE/rootfs" ] || step debootstrap-bookworm make_rootfs
}

pip_setting() {  # pip's value of an option: its environment variable, else its config
  local var
  var="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  if [ -n "${!var:-}" ]; then echo "${!var}"; return; fi
  python3 -m pip config list 2>/dev/null | sed -n "s/^global\.$1='\(.*\)'\$/\1/p" | tail -n 1
}

pip_links() {  # sets links: pip's find-links folder (a wheel folder), or empty
  links=$(pip_setting find-links); links=${links%% *}
  [ -n "$links" ] && [ -d "$links" ] || links=""
}

# pip_build_args [FIND_LINKS]: sets build_args: BASE_IMAGE, and pip's settings as
# secrets, which no layer, history or cache key keeps: the CA bundle as pip-ca, and a
# pip.conf as pip-conf naming it and FIND_LINKS (how the build reaches $links: a
# mounted folder or a URL). Where download.pytorch.org does not resolve, torch comes
# from FIND_LINKS.
pip_build_args() {
  local cert conf="$CACHE/pip-$PROG.conf"
  build_args=(--build-arg "BASE_IMAGE=$BASE")
  echo "[global]" >"$conf"
  cert=$(pip_setting cert)
  if [ -n "$cert" ] && [ -f "$cert" ]; then
    build_args+=(--secret "id=pip-ca,src=$cert")
    echo "cert = /run/secrets/pip-ca" >>"$conf"
  fi
  if [ -n "${1:-}" ]; then
    echo "find-links = $1" >>"$conf"
    getent hosts download.pytorch.org >/dev/null \
      || build_args+=(--build-arg TORCH_INDEX=https://pypi.org/simple)
  fi
  build_args+=(--secret "id=pip-conf,src=$conf")
}

# `diloco run tiny`, short: 20 steps of a smaller model, 2 rounds per fragment.
SHORT=(--set "model.overrides={d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 64}"
       --set data.seq_len=32 --set data.batch_size=8 --set train.steps=20
       --set train.eval_every=0 --set train.eval_batches=2 --set sync.schedule.sync_every=10
       --set sync.schedule.fragments=2 --set sync.schedule.overlap=1 --set optim.warmup_steps=4
       --set train.checkpoint_every=10 --set 'data.sources=["builtin:shakespeare/tragedies/*"]')
