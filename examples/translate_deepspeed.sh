#!/usr/bin/env bash
# Translate a DeepSpeed config into a plan, then train the demo model with it.
#   bash examples/translate_deepspeed.sh path/to/ds_config.json
set -euo pipefail
config=${1:?usage: translate_deepspeed.sh DS_CONFIG.json}
torsh-jax translate "$config" --world-size 8 -o translated.plan.toml
torsh-jax demo --plan translated.plan.toml --devices 8 --steps 10
