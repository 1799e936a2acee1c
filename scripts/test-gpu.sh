#!/usr/bin/env bash
# The CUDA/NCCL subset, on a machine with one or more GPUs: the manager's device choice and
# NCCL, every collective, the halo, the FFT, converted U-Net / AFNO / Swin / graph models against
# the serial ones, and a bf16 training step, on CUDA tensors (tests/mpi/gpu_cuda.py). One GPU: world 1 on
# NCCL, then 2 ranks sharing it over gloo; several: one rank per GPU (up to 4). Then the U-Net
# step on the device, P = 1.
#
# Uses the machine's own CUDA build of torch (never installs torch); installs what else is
# missing (mpich, mpi4py, pytest, pytest-mpi, h5py, numpy) from PyPI.
#
#   bash scripts/test-gpu.sh          # needs a GPU: fails loudly without one
#   bash scripts/test-gpu.sh --cpu    # the same steps on CPU tensors (gloo): a dry run
#   MPIDP_GPU_BENCH=0 ...             # without the step benchmark (CI's dry run)
set -euo pipefail
cd "$(dirname "$0")/.."
device=cuda
if [ "${1:-}" = "--cpu" ]; then device=cpu; fi
py="${PYTHON:-python3}"
if [ "$device" = cpu ] && [ -x .venv/bin/python ]; then py="$PWD/.venv/bin/python"; fi
"$py" -c "import torch" 2>/dev/null || { echo "test-gpu: no torch for $py"; exit 2; }
gpus=$("$py" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$device" = cuda ] && [ "$gpus" -eq 0 ]; then
  echo "test-gpu: torch $("$py" -c 'import torch; print(torch.__version__, torch.version.cuda)') sees no GPU; use --cpu for a dry run"
  exit 2
fi
"$py" -c "import mpi4py, pytest, pytest_mpi, h5py, hostlist" 2>/dev/null \
  || "$py" -m pip install -q mpich mpi4py pytest pytest-mpi h5py numpy pyyaml python-hostlist
bin="$(dirname "$("$py" -c 'import sys; print(sys.executable)')")"
mpiexec="$(command -v mpiexec || echo "$bin/mpiexec")"
[ -x "$mpiexec" ] || mpiexec="$("$py" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/mpiexec"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MPIDP_TEST_DEVICE="$device" OMP_NUM_THREADS=1
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1
"$py" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
import torch.distributed as dist
print(f"NCCL available: {dist.is_nccl_available()}")
PY
fail=0
worlds=1
if [ "$device" = cuda ] && [ "$gpus" -ge 2 ]; then worlds="1 $(( gpus < 4 ? gpus : 4 ))"; fi
if [ "$device" = cpu ]; then worlds="1 2"; fi
for n in $worlds; do
  echo; echo "=== tests/mpi/gpu_cuda.py on $device, $n rank(s)"
  timeout 900 "$mpiexec" -n "$n" "$py" -m mpi4py -m pytest -q --with-mpi -p no:cacheprovider \
    tests/mpi/gpu_cuda.py || { echo "gpu_cuda.py FAILED at $n rank(s)"; fail=1; }
done
if [ "$device" = cuda ] && [ "$gpus" -eq 1 ]; then
  # NCCL refuses two ranks on one GPU; over gloo they share it, so the layers' device paths
  # (halo buffers, FFT, converted models) still run at P = 2 on CUDA tensors
  echo; echo "=== tests/mpi/gpu_cuda.py on cuda, 2 ranks sharing the GPU over gloo"
  MPIDP_TEST_BACKEND=gloo timeout 900 "$mpiexec" -n 2 "$py" -m mpi4py -m pytest -q --with-mpi \
    -p no:cacheprovider tests/mpi/gpu_cuda.py || { echo "gpu_cuda.py FAILED over gloo"; fail=1; }
fi
if [ "${MPIDP_GPU_BENCH:-1}" != 0 ]; then
  echo; echo "=== U-Net step on $device (bench/gpu_step.py)"
  grid=(); [ "$device" = cpu ] && grid=(--grid 91 180)
  "$py" bench/gpu_step.py --device "$device" "${grid[@]}" || fail=1
fi
if [ "$fail" -ne 0 ]; then echo "test-gpu: FAILED"; exit 1; fi
echo "test-gpu: passed on $device"
