#!/usr/bin/env bash
# Gate communication volume: fail when a change makes the example models move more bytes
# per training step than the committed baselines. Regenerate a baseline on purpose with
#   shardc comm SPEC --mesh MESH --baseline FILE --update-baseline
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
for spec in mlp_chain gpt_small; do
  for mesh in x2y2z2d1 x8y1z1d1 x1y1z8d1 x2y1z2d2; do
    echo "== $spec on $mesh"
    shardc comm "shardc.tools.specs:$spec" --mesh "$mesh" --quiet \
      --baseline "examples/baselines/${spec}_${mesh}.json" --check || status=1
  done
done
exit $status
