#!/usr/bin/env bash
# The whole RL loop on one GPU: prepared here, run there. bench/gpu_rl.py says what the run does and prints.
#   bash bench/gpu_rl.sh prepare              here (PyPI reachable): the wheels the GPU machine lacks, for its
#                                             Python 3.12, in build/gpu_wheels/part1, part2, ... (each under 60 MiB:
#                                             a device call carries one; a wheel too big for one travels split)
#   bash bench/gpu_rl.sh run OUT [--steps N]  there, from the repo root: joins and installs the wheels carried so
#                                             far, then runs bench/gpu_rl.py OUT with the machine's python3
#   bash bench/gpu_rl.sh smoke OUT            here: the same run on CPU at tiny sizes in this checkout's venv
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=build/gpu_wheels
PART_MIB=56
# What instar imports that the GPU image lacks (its list: /work/.library/device/KINDS.md has torch 2.11,
# transformers, peft, numpy, pyarrow, pandas, aiohttp, ...), at the versions tested here (requirements/lock.txt).
NEED=(ray "jsonargparse[signatures]" fastapi uvicorn pydantic datasets math-verify)
# Already on the GPU image: their wheels are not carried (pip keeps the installed ones).
PRESENT=(absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
  charset-normalizer click cloudpickle colorama contourpy cycler filelock flatbuffers fonttools frozenlist fsspec
  grpcio h11 hf-xet httpcore httpx huggingface-hub idna jinja2 joblib kiwisolver markdown markdown-it-py markupsafe
  matplotlib mdurl mpmath msgpack multidict networkx numpy packaging pandas peft pillow pip pluggy propcache protobuf
  psutil pyarrow pygments pyparsing python-dateutil pytz pyyaml regex requests rich safetensors scipy setuptools
  shellingham six sympy tokenizers torch tqdm transformers triton typer typing-extensions tzdata urllib3 xxhash
  yarl zipp)

case "${1:-}" in
prepare)
  rm -rf "$WHEELS" && mkdir -p "$WHEELS/all"
  .venv/bin/pip download -q -d "$WHEELS/all" -c requirements/lock.txt --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any "${NEED[@]}"
  for wheel in "$WHEELS"/all/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1 | tr '_A-Z' '-a-z')
    if [[ " ${PRESENT[*]} " == *" $name "* ]]; then rm "$wheel"; fi
  done
  # wheels over one part's size go in pieces, joined there; then the files fill parts of at most PART_MIB
  for wheel in "$WHEELS"/all/*.whl; do
    if (($(stat -c %s "$wheel") > PART_MIB * 1048576)); then
      split -b $((PART_MIB / 2))M -d "$wheel" "$wheel.piece" && rm "$wheel"
    fi
  done
  part=1 used=0
  mkdir -p "$WHEELS/part1"
  while IFS= read -r file; do  # the largest first
    size=$(stat -c %s "$WHEELS/all/$file")
    if ((used + size > PART_MIB * 1048576)); then part=$((part + 1)) used=0 && mkdir -p "$WHEELS/part$part"; fi
    mv "$WHEELS/all/$file" "$WHEELS/part$part/" && used=$((used + size))
  done < <(ls -S "$WHEELS/all")
  rmdir "$WHEELS/all"
  du -sh "$WHEELS"/part*
  echo "carry one part a call: run(command=..., carry=[\"$WHEELS/partN\"]); the last call runs: bash bench/gpu_rl.sh run OUT"
  ;;
run)
  shift
  if compgen -G "$WHEELS/part*/*" >/dev/null; then
    mkdir -p "$WHEELS/joined"
    for first in "$WHEELS"/part*/*.piece00; do  # a wheel's pieces may lie in different parts
      [[ -e "$first" ]] || continue
      base=$(basename "${first%.piece00}") i=0
      : >"$WHEELS/joined/$base"
      while piece=$(compgen -G "$WHEELS/part*/$base.piece$(printf %02d $i)"); do
        cat "$piece" >>"$WHEELS/joined/$base" && i=$((i + 1))
      done
    done
    cp "$WHEELS"/part*/*.whl "$WHEELS/joined/" 2>/dev/null || true
    python3 -m pip install -q --no-index --no-deps "$WHEELS"/joined/*.whl
    python3 -m pip check || true  # what is still missing, said before the run fails on it
  fi
  exec timeout -k 10 560 python3 bench/gpu_rl.py "$@"
  ;;
smoke)
  shift
  exec .venv/bin/python bench/gpu_rl.py "$@" --cpu-smoke
  ;;
*)
  sed -n 2,8p "$0"
  exit 2
  ;;
esac
