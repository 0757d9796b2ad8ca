#!/usr/bin/env bash
# The peers of `python -m mok_cute.bench --peers sonicmoe` (mok_cute/bench/peers.py) on a GPU machine
# without network: installs the wheels of WHEEL_DIR (default .peers/wheels: sonic-moe, quack-kernels
# and their pure-Python dependencies) offline into .peers/lib/site-packages and prints the PYTHONPATH export.
#   eval "$(bash tools/peer_env.sh [WHEEL_DIR])" && python -m mok_cute.bench --peers sonicmoe ...
# --no-deps: torch, triton, nvidia-cutlass-dsl and cuda-python stay the environment's own (mok_cute's),
# whatever versions the peers' metadata pins.
set -euo pipefail
wheels="${1:-.peers/wheels}"
site="$(pwd)/.peers/lib/site-packages"  # a site-packages path: QuACK fingerprints (walks into) only code outside one
shopt -s nullglob
files=("$wheels"/*.whl)
if (( ${#files[@]} == 0 )); then
    echo "peer_env.sh: no wheels in $wheels" >&2
    exit 1
fi
py="${PYTHON:-python3}"
if ! "$py" -m pip install --quiet --no-index --no-deps --upgrade --target "$site" "${files[@]}" >&2; then
    echo "peer_env.sh: pip failed; unpacking the wheels (zip archives) into $site instead" >&2
    "$py" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$site" "${files[@]}"
fi
echo "export PYTHONPATH=\"$site\${PYTHONPATH:+:\$PYTHONPATH}\""
