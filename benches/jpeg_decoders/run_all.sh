#!/bin/sh
# The JPEG decoder bench in one run: makes the test images and boxes if
# missing, builds the Rust bench, runs ROUNDS interleaved rounds (each: the
# Rust bench then pil_bench.py, on both image sets, PASSES passes + 1
# warm-up each) and writes OUT/summary.md (about 6 minutes on 2 cores).
#
#   benches/jpeg_decoders/run_all.sh [OUT]
#
# OUT: where images, boxes and results go (argument, or $OUT; default
# bench-results/jpeg_decoders under the repository root).
# PYTHON: an interpreter with Pillow, numpy, torch and torchvision
# (default python3). CARGO_TARGET_DIR: default build/jpeg-decoders-target
# under the repository root. ROUNDS (default 5), PASSES (default 7).
# Needs cmake and nasm for libjpeg-turbo (see README.md).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-${OUT:-$root/bench-results/jpeg_decoders}}
py=${PYTHON:-python3}
rounds=${ROUNDS:-5}
passes=${PASSES:-7}
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/build/jpeg-decoders-target}
export CARGO_TARGET_DIR
case $rounds$passes in
*[!0-9]*) echo "run_all.sh: ROUNDS and PASSES must be whole numbers" >&2; exit 2 ;;
esac
if [ "$rounds" -lt 1 ] || [ "$rounds" -gt 100 ] || [ "$passes" -lt 1 ] || [ "$passes" -gt 1000 ]; then
    echo "run_all.sh: ROUNDS must be 1-100 and PASSES 1-1000" >&2
    exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ "$out" = "$here" ]; then
    echo "run_all.sh: OUT must not be the source folder $here" >&2
    exit 2
fi

if [ ! -f "$out/images/199.jpg" ] || [ ! -f "$out/images_waves85/199.jpg" ]; then
    "$py" "$here/gen_images.py" "$out"
fi
if [ ! -f "$out/boxes.txt" ]; then
    "$py" "$here/make_boxes.py" "$out/boxes.txt"
fi
cargo build --release --locked --manifest-path "$here/Cargo.toml"
bench=$CARGO_TARGET_DIR/release/shardstream-bench-jpeg

# Relative image-set names, so that the raw files and the summary name them so.
cd "$out"
rm -f raw.r*.csv load.log
r=1
while [ "$r" -le "$rounds" ]; do
    for set in images images_waves85; do
        echo "round $r $set $(uptime)" >> load.log
        RAW=raw.r$r.csv "$bench" "$set" boxes.txt "$passes" > "rust_$set.r$r.md" 2> "rust_$set.log"
        RAW=raw.r$r.csv "$py" "$here/pil_bench.py" "$set" boxes.txt "$passes" > "pil_$set.r$r.md"
    done
    r=$((r + 1))
done
echo "end $(uptime)" >> load.log
"$py" "$here/summarize.py" raw.r*.csv > summary.md
cat summary.md
