#!/usr/bin/env bash
# Convenience entry point; the logic lives in scripts/get_data.sh (see data/README.md).
exec "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../scripts/get_data.sh" "$@"
