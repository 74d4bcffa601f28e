#!/usr/bin/env bash
# Cloud TPU VM launcher; see launch/tpu_vm.py (or --help) for actions and flags.
exec python3 "$(dirname "${BASH_SOURCE[0]}")/tpu_vm.py" "$@"
