#!/usr/bin/env bash
# Print which torch build setup.sh installs here: "cpu" (PyTorch's +cpu wheel) on Linux without an NVIDIA
# GPU, where PyPI's wheel is the CUDA build with gigabytes of NVIDIA libraries; else "default" (PyPI's wheel:
# CUDA on Linux, CPU on macOS).
set -euo pipefail
if [ "$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null && [ ! -e /proc/driver/nvidia ]; then
  echo cpu
else
  echo default
fi
