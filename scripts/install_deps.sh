#!/usr/bin/env bash
# Installs the Debian 12 packages Kiln needs to build, test and train, skipping those already present.
set -euo pipefail
packages=(cmake ninja-build g++ pkg-config libeigen3-dev libhdf5-dev hdf5-tools libgtest-dev zlib1g-dev
          dataset-fashion-mnist openmpi-bin libopenmpi-dev nlohmann-json3-dev libstb-dev
          python3-h5py python3-numpy)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all packages present"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install_deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
