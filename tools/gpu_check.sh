#!/usr/bin/env bash
# The GPU checks of one lent device session, in the order they matter, each stage under
# its own time limit so that one slow stage leaves the others their time. Run from the
# repository root on a machine with one CUDA GPU and torch installed (no registry needed:
# the project goes in with --no-deps); logs go to $OUT (default ./gpu_out).
#
#   bash tools/gpu_check.sh                 # every stage
#   STAGES="single test" bash tools/gpu_check.sh
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
STAGES=${STAGES:-"single test large"}
export PYTHONUNBUFFERED=1
rm -rf /tmp/shardc_site  # a warm machine keeps the last copy, which pip --target would not replace
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/shardc_site . \
    >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/shardc_site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

for stage in $STAGES; do
  case $stage in
    single)  # GPT-2 small, bf16: every variant, side by side (the issue 33 table)
      timeout 250 python3 benchmarks/gpu_single.py --shapes gpt2-small --warmup 4 --steps 10 \
        --variants eager,torch.compile,torch.compile:cudagraphs,shardc,shardc:inductor --profile 12 \
        2>&1 | tee "$OUT/single.log" | grep -v Warning ;;
    test)    # real models train on CUDA (8 threaded ranks) as one device does
      # from tests/: python -m puts the working directory first on sys.path, and the
      # repository root's shardc/ is not the installed package (passes/, runtime/ beside it)
      (cd tests && timeout 130 python3 -m pytest -q -x -p no:cacheprovider test_gpu.py) \
        2>&1 | tee "$OUT/test.log" | tail -30 ;;
    large)   # the ~0.5B GPT, bf16
      timeout 190 python3 benchmarks/gpu_single.py --shapes gpt-0.5b --warmup 4 --steps 8 \
        --variants eager,torch.compile,shardc:inductor \
        2>&1 | tee "$OUT/large.log" | grep -v Warning ;;
  esac
done
