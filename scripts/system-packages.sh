#!/usr/bin/env bash
# The system packages the test suite needs beyond Python's: Debian's `docker-compose` (validates
# docker-compose.yml: tests/deploy) and `chromium` (renders reports). Run by `make test`.
# As root with apt-get, installs what is missing; otherwise prints what is missing and how to
# install it, and fails.
set -euo pipefail

# command -> the Debian package that provides it
declare -A PACKAGES=([docker-compose]=docker-compose [chromium]=chromium)

missing=()
for command in "${!PACKAGES[@]}"; do
    command -v "$command" >/dev/null 2>&1 || missing+=("${PACKAGES[$command]}")
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
IFS=$'\n' missing=($(LC_ALL=C sort <<<"${missing[*]}")); unset IFS

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "system-packages: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    exit 0
fi
echo "system-packages: missing ${missing[*]} (the tests need them); install with:" >&2
echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
exit 1
