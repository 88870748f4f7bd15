#!/bin/sh
# model-fetch: the head pod's init container (k8s/README.md, "The model volume").
#
# Downloads one pinned model revision from object storage (rclone: MODEL_SOURCE is
# "<remote>:<bucket>/<path of that revision>") into $MODELS_DIR/<name>@<revision>, checks its
# content hash against MODEL_SHA256 before anything may load it, and points
# $MODELS_DIR/current (cluster.yaml's model.path) at it. A revision already verified is kept.
#
# The content hash: sha256 over the lines "<sha256 of the file>  ./<path>" of every file of the
# revision, sorted by path in the C locale -- compute it for a local copy with
#   (cd DIR && find . -type f ! -name .baton-sha256 | LC_ALL=C sort |
#      while IFS= read -r f; do sha256sum "$f"; done) | sha256sum
# Only the head pod fetches: the workers' actors load the model after the gateway starts, and
# the gateway starts after this container has succeeded.
set -eu
: "${MODEL_SOURCE:?MODEL_SOURCE is not set}" "${MODEL_NAME:?MODEL_NAME is not set}"
: "${MODEL_REVISION:?MODEL_REVISION is not set}" "${MODEL_SHA256:?MODEL_SHA256 is not set}"
root="${MODELS_DIR:-/models}"

case "$MODEL_SHA256" in
  *[!0-9a-f]*) echo "model-fetch: MODEL_SHA256 must be 64 lowercase hex digits" >&2; exit 1 ;;
esac
if [ "${#MODEL_SHA256}" -ne 64 ]; then
  echo "model-fetch: MODEL_SHA256 must be 64 lowercase hex digits" >&2; exit 1
fi
case "$MODEL_NAME$MODEL_REVISION" in
  */*|*..*) echo "model-fetch: MODEL_NAME and MODEL_REVISION may not contain / or .." >&2; exit 1 ;;
esac
if [ -d "$root/current" ] && [ ! -L "$root/current" ]; then
  echo "model-fetch: $root/current is a directory, not a link: move it aside first" >&2; exit 1
fi

tree_sha256() {
  (cd "$1" && find . -type f ! -name .baton-sha256 | LC_ALL=C sort |
    while IFS= read -r f; do sha256sum "$f"; done) | sha256sum | cut -d' ' -f1
}

name="$MODEL_NAME@$MODEL_REVISION"
dest="$root/$name"
if [ -f "$dest/.baton-sha256" ] && [ "$(cat "$dest/.baton-sha256")" = "$MODEL_SHA256" ]; then
  echo "model-fetch: $name is here and verified"
else
  tmp="$root/.fetch-$name-${HOSTNAME:-local}"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  echo "model-fetch: $MODEL_SOURCE -> $tmp"
  rclone copy --checksum --transfers 8 "$MODEL_SOURCE" "$tmp"
  got="$(tree_sha256 "$tmp")"
  if [ "$got" != "$MODEL_SHA256" ]; then
    rm -rf "$tmp"
    echo "model-fetch: content sha256 is $got, expected $MODEL_SHA256: refusing $name" >&2
    exit 1
  fi
  printf '%s\n' "$MODEL_SHA256" > "$tmp/.baton-sha256"
  rm -rf "$dest"
  mv "$tmp" "$dest"
  echo "model-fetch: $name verified"
fi
ln -sfn "$name" "$root/current"
echo "model-fetch: $root/current -> $name"
