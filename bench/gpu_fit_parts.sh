#!/usr/bin/env bash
# SmolLM2-135M's folder and the wheels the device image lacks, in parts that the device tool can carry
# (64 MiB a call, the working tree included), for bench/gpu_fit.py on a GPU machine (issue 49).
#
#   bash bench/gpu_fit_parts.sh [MODEL_FOLDER]   # here: writes runs/gpu_fit_parts/, prints the device calls
#   bash bench/gpu_fit_parts.sh --join           # on the device machine, in the last upload call
#
# Here: downloads into runs/gpu_fit_parts/whl the wheels rlcli needs that the device image ('cuda',
# .library/device/KINDS.md) does not hold, at the versions of this .venv, for CPython 3.12 on x86-64;
# packs them with MODEL_FOLDER (default: rlcli's cache, ~/.cache/rlcli/models/smollm2-135m, pulled if
# missing) into one tar.gz (gzip takes the bfloat16 weights from 269 to 195 MB; with the 46 MB of wheels
# about 235 MiB), and splits it into 60 MiB pieces, one per folder runs/gpu_fit_parts/p1..p4, the last
# with the sha256. runs/ is in .gitignore: nothing here travels unless a call carries it.
#
# --join (device): puts together the pieces the earlier calls copied to /tmp/gf, checks the sha256,
# unpacks SmolLM2 into /tmp/smollm2-135m and the wheels into /tmp/whl, installs the wheels and rlcli
# itself (from the working tree that travelled) into /tmp/site, and checks that rlcli, trl and
# bitsandbytes import there.
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=runs/gpu_fit_parts
PIECE=60M

if [[ "${1:-}" == "--join" ]]; then
    cat /tmp/gf/gpu_fit.tgz.[0-9] >/tmp/gpu_fit.tgz
    (cd /tmp && sha256sum -c gf/gpu_fit.tgz.sha256)
    tar -xzf /tmp/gpu_fit.tgz -C /tmp && rm /tmp/gpu_fit.tgz
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        /tmp/whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .
    PYTHONPATH=/tmp/site python3 -c "
import bitsandbytes, torch, transformers, trl, rlcli.cli.app
print('joined: torch', torch.__version__, 'CUDA', torch.cuda.is_available(), 'transformers', transformers.__version__,
      'trl', trl.__version__, 'bitsandbytes', bitsandbytes.__version__)"
    ls -l /tmp/smollm2-135m
    exit 0
fi

MODEL=${1:-${RLCLI_MODELS:-$HOME/.cache/rlcli/models}/smollm2-135m}
if [[ ! -f "$MODEL/config.json" ]]; then
    .venv/bin/rlcli models pull smollm2-135m
fi
[[ -f "$MODEL/config.json" ]] || { echo "no model folder at $MODEL" >&2; exit 1; }

# What rlcli imports that the device image lacks (trl, bitsandbytes, datasets, sqlite-utils, pydantic) and
# what they need beyond it; --no-deps everywhere, so each one is named.
WHEELS="trl bitsandbytes datasets dill multiprocess sqlite-utils sqlite-fts4 click-default-group pydantic
pydantic-core annotated-types typing-inspection"
mkdir -p "$PARTS"/whl
for name in $WHEELS; do
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
    stem=$(echo "$name" | tr '-' '_')
    if ! ls "$PARTS"/whl/ 2>/dev/null | grep -qi "^${stem}-${version}-"; then
        .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
            -d "$PARTS"/whl "$name==$version"
    fi
done

rm -rf "$PARTS"/p* "$PARTS"/tmp
mkdir -p "$PARTS"/tmp
# One tar.gz: smollm2-135m/ (whatever the folder is called here) and whl/.
tar -czf "$PARTS"/tmp/gpu_fit.tgz -C "$(dirname "$MODEL")" --transform "s,^$(basename "$MODEL"),smollm2-135m," \
    "$(basename "$MODEL")" -C "$PWD/$PARTS" whl
(cd "$PARTS"/tmp && sha256sum gpu_fit.tgz >gpu_fit.tgz.sha256)
split -b "$PIECE" -d -a 1 "$PARTS"/tmp/gpu_fit.tgz "$PARTS"/tmp/gpu_fit.tgz.
n=0
for piece in "$PARTS"/tmp/gpu_fit.tgz.[0-9]; do
    n=$((n + 1))
    mkdir -p "$PARTS/p$n"
    mv "$piece" "$PARTS/p$n/"
done
mv "$PARTS"/tmp/gpu_fit.tgz.sha256 "$PARTS/p$n/"
rm -rf "$PARTS"/tmp

echo "Pieces in $PARTS:" >&2
du -sh "$PARTS"/p* >&2
tree_mib=$(($(git ls-files -z | xargs -0 cat | wc -c) / 1048576))
echo "The working tree that travels with every call: about $tree_mib MiB (the limit is 64 MiB a call)." >&2
echo
echo "Device calls (the device tool's run), one straight after the other (the machine stays warm 30 s):"
for k in $(seq 1 $((n - 1))); do
    echo "  $k. carry [\"$PARTS/p$k\"]"
    echo "     mkdir -p /tmp/gf && cp $PARTS/p$k/* /tmp/gf/ && ls -l /tmp/gf"
done
echo "  $n. carry [\"$PARTS/p$n\"], timeout_s 600"
echo "     mkdir -p /tmp/gf && cp $PARTS/p$n/* /tmp/gf/ && bash bench/gpu_fit_parts.sh --join || exit 1;" \
    "export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; python3 bench/gpu_fit.py --smollm2 /tmp/smollm2-135m" \
    "--only quickstart vs_trl --vs-trl-args=\"--steps 10\" --out \$OUT/gpu_fit_a.json 2>\$OUT/gpu_fit_a.log"
echo "  $((n + 1)). no carry, timeout_s 600"
echo "     export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; python3 bench/gpu_fit.py --smollm2 /tmp/smollm2-135m" \
    "--only shapes --out \$OUT/gpu_fit_b.json 2>\$OUT/gpu_fit_b.log"
