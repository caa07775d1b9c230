#!/usr/bin/env bash
# Install a real harness from its registry once, pinned, into $FORGE_CACHE/harnesses/<name>-<version>.
# Usage: scripts/harness.sh codex|claude-code   (prints the path of its executable)
set -euo pipefail
cache="${FORGE_CACHE:-/var/cache/openforge}/harnesses"
case "${1:-}" in
  codex) package="@openai/codex"; version="0.171.0"; bin="node_modules/.bin/codex" ;;
  claude-code) package="@anthropic-ai/claude-code"; version="2.1.332"
    bin="node_modules/@anthropic-ai/claude-code/bin/claude.exe" ;;
  *) echo "harness.sh: unknown harness '${1:-}' (known: codex, claude-code)" >&2; exit 2 ;;
esac
dir="$cache/$1-$version"
if [ ! -x "$dir/$bin" ]; then
  command -v npm >/dev/null || { echo "harness.sh: npm is needed to install $package" >&2; exit 2; }
  mkdir -p "$cache"
  stage=$(mktemp -d "$cache/.$1-XXXXXX")
  trap 'rm -rf "$stage"' EXIT
  npm install --no-audit --no-fund --loglevel=error --prefix "$stage" "$package@$version" >&2
  if [ "$1" = claude-code ]; then  # npm 11 skips its postinstall, which fetches the native binary
    (cd "$stage/node_modules/@anthropic-ai/claude-code" && node install.cjs >&2)
  fi
  rm -rf "$dir" && mv "$stage" "$dir" && chmod -R a+rX "$dir"
  trap - EXIT
  echo "harness.sh: installed $package@$version in $dir" >&2
fi
echo "$dir/$bin"
