# Sourced by the A/B scripts (encoder_ab.sh, variants.sh): one way to make a patched copy.
# patched_tree ROOT PATCH DEST: DEST made afresh as a copy of the tree ROOT with PATCH (a path
# relative to ROOT) applied; on failure DEST is removed, the error goes to stderr, status 1.
patched_tree() {
  local root=$1 patch=$2 dest=$3
  rm -rf "$dest" && mkdir -p "$(dirname "$dest")" && cp -r "$root" "$dest" && (cd "$dest" && git apply "$root/$patch") \
    || { echo "patch $patch does not apply to $root" >&2; rm -rf "$dest"; return 1; }
}
