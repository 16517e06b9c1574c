#!/usr/bin/env bash
# Copies the header-only libraries Kiln builds with (nlohmann-json, stb) from this machine's /usr/include into
# the ignored .deps/include, for a machine that lacks them and cannot install them (the GPU machine: name
# .deps in the device tool's carry). CMake looks there when the system has none.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps/include
for d in nlohmann stb; do
  [ -d "/usr/include/$d" ] || { echo "vendor_headers: /usr/include/$d is missing (bash scripts/install_deps.sh)" >&2; exit 1; }
  rm -rf ".deps/include/$d"
  cp -r "/usr/include/$d" .deps/include/
done
du -sh .deps/include
