#!/bin/bash
# The one prepared command of a lent GPU session (docs/gpu.md): every part of the check, in
# order of value, each under its own timeout within one budget (GPU_CHECK_BUDGET seconds,
# default 470), each writing its figures and log; a summary table at the end.
#   bash scripts/gpu_check.sh                # every part
#   bash scripts/gpu_check.sh plan           # what would run, each part's timeout (any machine)
#   bash scripts/gpu_check.sh diagnosis      # chosen parts; `tests` = cuda_tests trainers
# Files: $OUT where set (the device machine), else outputs/gpu_check/<time> (scripts/gpu_check.py).
# The wheels the GPU machines lack travel in .whl/ (bash scripts/gpu_wheels.sh here; run with
# carry [".whl"]): installed into /tmp/site, and selfspec runs from this checkout
# (PYTHONPATH), never installed.
cd "$(dirname "$0")/.." || exit 1
python=${PYTHON:-python3}
if [[ $1 != plan && $1 != --dry-run ]] && compgen -G ".whl/*.whl" >/dev/null; then
    if "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl; then
        export PYTHONPATH=/tmp/site:$PWD
    else
        echo "warning: the wheels in .whl/ did not install; parts that need them will fail" >&2
        export PYTHONPATH=$PWD
    fi
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export WANDB_MODE=disabled PYTHONUNBUFFERED=1
exec "$python" scripts/gpu_check.py "$@"
