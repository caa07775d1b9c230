#!/usr/bin/env bash
# Debian packages the tests use, installed once when missing (idempotent; needs root, as the namespace tests do):
# iptables/ip6tables for `forge net-init` and transparent mode, chromium to open the collector's HTML viewer.
set -uo pipefail
missing=()
command -v iptables >/dev/null || missing+=(iptables)
command -v chromium >/dev/null || missing+=(chromium)
[ ${#missing[@]} = 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "system.sh: ${missing[*]} missing and not root: install them (apt-get install -y ${missing[*]})" >&2
  exit 2
fi
apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }
