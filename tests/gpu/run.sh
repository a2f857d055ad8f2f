#!/bin/bash
# The GPU checks, in one call of the device machine (CUDA torch and JAX, numpy 2, no MXNet):
# the CUDA rows of the parity grid, the conformance grid on the GPU, the report on cpu and
# cuda, all at once; then the timings alone (tests/gpu/speed_*.py). Logs go to $OUT.
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD ATTENTION_MULTI_REQUIRE=numpy,torch,jax
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # (JAX takes 75% of the GPU per process otherwise)
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -c "import torch, jax, numpy; print('torch', torch.__version__, torch.cuda.get_device_name(0)); print('jax', jax.__version__, jax.devices()); print('numpy', numpy.__version__)"
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
(timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 --matrix=full -k cuda tests/test_parity.py > $OUT/parity.log 2>&1; echo "parity rc $?" >> $OUT/parity.log) &
(timeout 200 python3 tests/gpu/conform_on.py cuda --impl am-torch --json $OUT/am_torch_cuda.json > $OUT/conform_torch.log 2>&1; echo "rc $?" >> $OUT/conform_torch.log) &
(timeout 200 python3 -m attention_multi conform --impl am-jax --quick > $OUT/conform_jax.log 2>&1; echo "rc $?" >> $OUT/conform_jax.log) &
(timeout 200 python3 -m attention_multi report --backends numpy,torch,jax --devices cpu,cuda --out /tmp/report > $OUT/report.log 2>&1; echo "rc $?" >> $OUT/report.log) &
wait
echo "== parity"; tail -4 $OUT/parity.log
echo "== conform torch on cuda"; grep -E "^conform|rc |^- " $OUT/conform_torch.log | head -30
echo "== conform jax"; grep -E "^conform|rc |^- " $OUT/conform_jax.log | head
echo "== report"; tail -6 $OUT/report.log
echo "== torch speed"; timeout 170 python3 tests/gpu/speed_torch.py cuda 2>&1 | grep -v -i warn | tee $OUT/speed.log
echo "== jax speed"; timeout 90 python3 tests/gpu/speed_jax.py 2>&1 | grep -v -i warn | tee $OUT/jax.log
