#!/usr/bin/env bash
# Issue 33's allocator retries after offloaded checkpoints stopped deferring the free of each layer's input
# (fitune/runtime/techniques/offload.py: the compute stream waits for the transfer instead of `record_stream`), and
# its context goal in one call: bench/calls/issue33_retries.sh (the GPU test of offloaded checkpoints, then context
# lanes, each process under its own cap) with these lanes: `fitune plan --host-ram 64GiB`'s longest QLoRA r32
# all-linear context at the 24 GB cap; Unsloth at the same cap at the lengths of bench/results/issue33/context_pool
# (87,381 out of memory, 81,920 fitted), then fitune's longest at the 16 GB cap (15.4 GiB) with 64 GiB;
# `fitune plan --host-ram 32GiB`'s longest at 24 GB. The records say the retries of every step.
#   export PYTHONPATH=.:$PWD/.peers_site; FITUNE_COMMIT=... bash bench/calls/issue33_noretry.sh $OUT
set -u
ISSUE33_LANES='fitune@23.4GiB:plan:$H64|unsloth@23.4GiB:87381,81920 fitune@15.4GiB:plan:$H64|fitune@23.4GiB:plan:$H32' \
  exec bash "$(dirname "$0")/issue33_retries.sh" "$@"
