#!/bin/sh
# Install OpenStack Swift (with s3api) from Debian's packages for the S3 tier tests and
# `musacache bench tiers`. Idempotent: does nothing when every server binary is present.
# No server is started here; tests/s3_servers.py and musacache._testing.swift start their own.
set -eu

PACKAGES="swift-proxy swift-account swift-container swift-object"
BINARIES="swift-proxy-server swift-account-server swift-container-server swift-object-server"

missing=""
for b in $BINARIES; do
    command -v "$b" >/dev/null 2>&1 || missing="$missing $b"
done
if [ -z "$missing" ] && [ -x /usr/bin/python3 ]; then
    echo "swift-install: already installed"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
# shellcheck disable=SC2086  # the package list is meant to split
$SUDO apt-get install -y $PACKAGES
for b in $BINARIES; do
    command -v "$b" >/dev/null 2>&1 || { echo "swift-install: $b still missing" >&2; exit 1; }
done
echo "swift-install: installed"
