#!/usr/bin/env bash
# The torch range, run for real (not part of CI: each side environment pulls torch's CUDA
# packages, a few GB). For each torch version given (default: the floor, the middle the
# GPU image carries, and the newest on the registry), build a side virtual environment,
# install torch then the project over it as a user would, and run `shardc demo` and the
# one-process test tier, then the gloo tests that the range once broke. Prints one line a
# version; the logs stay in $MATRIX_DIR/<version>.log.
#
#   tools/torch_matrix.sh                   # 2.8.0 2.11.0 and the newest
#   tools/torch_matrix.sh 2.9.1 2.15.0      # the versions named
#   MATRIX_DIR=/tmp/m KEEP=1 tools/torch_matrix.sh   # reuse environments already built
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${MATRIX_DIR:-$root/.matrix}
mkdir -p "$dir"
newest() {
    # this machine's pip configuration may cap torch (PIP_CONSTRAINT=/dev/null lifts it)
    PIP_CONSTRAINT=/dev/null python3 -m pip index versions torch 2>/dev/null \
        | sed -n 's/^torch (\(.*\))$/\1/p'
}
versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
    floor=$(python3 -c "import re;t=open('$root/shardc/core/compat.py').read();print('.'.join(re.search(r'TORCH_FLOOR = \((\d+), (\d+)\)',t).groups())+'.0')")
    versions=("$floor" "2.11.0" "$(newest)")
fi
# the one-process tier (fake process groups), then the gloo tests the range broke
tier=(tests/test_torch_range.py tests/test_layers.py tests/test_options.py tests/test_compile.py tests/test_step_passes.py
      tests/test_placement.py tests/test_mesh.py tests/test_agreement.py tests/test_memory_options.py
      tests/test_stages.py tests/test_ring.py tests/test_sequence_parallel.py tests/test_planner.py)
gloo=(tests/test_step_graph_gloo.py tests/test_hash_seed_gloo.py tests/test_backend_inductor.py tests/test_experts.py
      tests/test_experts_gloo.py tests/test_pipeline_gloo.py tests/test_context_gloo.py
      tests/test_sequence_parallel_gloo.py)
status=0
for v in "${versions[@]}"; do
    env="$dir/torch-$v"
    log="$dir/$v.log"
    : > "$log"
    if [ -z "${KEEP:-}" ] || [ ! -x "$env/bin/python" ]; then
        rm -rf "$env"
        python3 -m venv "$env" >> "$log" 2>&1
        {
            PIP_CONSTRAINT=/dev/null "$env/bin/python" -m pip install -q "torch==$v" &&
            PIP_CONSTRAINT=/dev/null "$env/bin/python" -m pip install -q -e "$root[test]" &&
            "$env/bin/python" -m pip install -q --no-deps "litgpt==0.5.13" &&
            PIP_CONSTRAINT=/dev/null "$env/bin/python" -m pip install -q lightning psutil \
                "jsonargparse[signatures]<=4.41"
        } >> "$log" 2>&1 || { echo "torch $v: install failed (see $log)"; status=1; continue; }
    else
        # a kept environment keeps its torch and the project's dependencies, and is pointed
        # at this checkout (an editable install made from another checkout would test that)
        "$env/bin/python" -m pip install -q --no-deps -e "$root" >> "$log" 2>&1 ||
            { echo "torch $v: install failed (see $log)"; status=1; continue; }
    fi
    got=$("$env/bin/python" -c "import torch; print(torch.__version__)" 2>>"$log")
    (cd "$root" && "$env/bin/shardc" demo --steps 3) >> "$log" 2>&1
    demo=$?
    (cd "$root" && "$env/bin/python" -m pytest -q -p no:cacheprovider -m "not distributed" \
        "${tier[@]}") >> "$log" 2>&1
    one=$?
    (cd "$root" && "$env/bin/python" -m pytest -q -p no:cacheprovider "${gloo[@]}") >> "$log" 2>&1
    multi=$?
    summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$log" | tr '\n' ' ')
    verdict=pass
    [ $demo -eq 0 ] && [ $one -eq 0 ] && [ $multi -eq 0 ] || { verdict=FAIL; status=1; }
    echo "torch $got: $verdict (demo rc=$demo, one-process rc=$one, gloo rc=$multi) $summary"
done
exit $status
