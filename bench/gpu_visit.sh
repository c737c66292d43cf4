#!/usr/bin/env bash
# The former name of bench/gpu_run.sh, kept until every page cites the new one: runs it.
exec bash "$(dirname "$0")/gpu_run.sh" "$@"
