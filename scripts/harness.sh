#!/usr/bin/env bash
# Install a real harness from its registry once, pinned, into $FORGE_CACHE/harnesses/<name>-<version>.
# Usage: scripts/harness.sh codex|claude-code|mini-swe-agent|qwen-code|pi|ai-sdk|openai-agents
# (prints the path of its executable; for a JS library, ai-sdk or openai-agents, its node_modules folder, which a
# script beside a link to it imports from)
set -euo pipefail
cache="${FORGE_CACHE:-/var/cache/openforge}/harnesses"
case "${1:-}" in
  codex) package="@openai/codex"; version="0.171.0"; bin="node_modules/.bin/codex" ;;
  claude-code) package="@anthropic-ai/claude-code"; version="2.1.332"
    bin="node_modules/@anthropic-ai/claude-code/bin/claude.exe" ;;
  qwen-code) package="@qwen-code/qwen-code"; version="0.24.4"; bin="node_modules/.bin/qwen" ;;
  pi) package="@mariozechner/pi-coding-agent"; version="0.73.1"; bin="node_modules/.bin/pi" ;;
  # Libraries a harness is built on, several packages pinned together (zod: their peer dependency).
  ai-sdk) package="ai"; version="7.0.185"; bin="node_modules"
    also="@ai-sdk/openai@4.0.126 @ai-sdk/anthropic@4.0.112 zod@4.6.7" ;;
  openai-agents) package="@openai/agents"; version="0.20.0"; bin="node_modules"; also="zod@4.6.7" ;;
  mini-swe-agent) package="mini-swe-agent"; req="$(cd "$(dirname "$0")/.." && pwd)/requirements/harness-mini-swe-agent.txt"
    version="$(grep '^mini-swe-agent==' "$req" | cut -d= -f3)-$(sha256sum "$req" | cut -c1-8)"; bin="bin/mini" ;;
  *) echo "harness.sh: unknown harness '${1:-}' (known: codex, claude-code, mini-swe-agent, qwen-code, pi, ai-sdk, openai-agents)" >&2; exit 2 ;;
esac
also="${also:-}"
dir="$cache/$1-$version${also:+-$(echo "$also" | sha256sum | cut -c1-8)}"  # the pins together name the folder
if [ "$1" = mini-swe-agent ]; then
  # A Python harness: its own venv, built in place (venvs do not move), the pinned closure, nothing resolved;
  # .complete marks a finished build.
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir" && mkdir -p "$cache"
    python3 -m venv "$dir"
    "$dir/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$req" 2>&1 \
      | { grep -v "is neither a file nor a directory" || true; } >&2
    chmod -R a+rX "$dir" && touch "$dir/.complete"
    echo "harness.sh: installed $package in $dir" >&2
  fi
  echo "$dir/$bin"
  exit 0
fi
if [ ! -x "$dir/$bin" ]; then
  mkdir -p "$cache"
  stage=$(mktemp -d "$cache/.$1-XXXXXX")
  trap 'rm -rf "$stage"' EXIT
  command -v npm >/dev/null || { echo "harness.sh: npm is needed to install $package" >&2; exit 2; }
  npm install --no-audit --no-fund --loglevel=error --prefix "$stage" "$package@$version" $also >&2
  if [ "$1" = claude-code ]; then  # npm 11 skips its postinstall, which fetches the native binary
    (cd "$stage/node_modules/@anthropic-ai/claude-code" && node install.cjs >&2)
  fi
  rm -rf "$dir" && mv "$stage" "$dir" && chmod -R a+rX "$dir"
  trap - EXIT
  echo "harness.sh: installed $package@$version $also in $dir" >&2
fi
echo "$dir/$bin"
