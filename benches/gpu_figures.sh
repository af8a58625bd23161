#!/usr/bin/env bash
# The GPU figures of docs/performance.md in one run, on a machine with a CUDA
# device (about 8 minutes with 16 cores and an H100 for train and s3, and
# about 2 more for boundary: run PARTS=boundary on its own when a call is
# limited to 10 minutes):
#   - "train": `make bench-train`'s table (ResNet-18 and ResNet-50, bf16,
#     batch 256, 4 and 8 workers; every pipeline, the GPU decode included);
#   - "boundary": ResNet-18 at 16 workers over 60 timed steps (past the
#     epoch's end), with and without persistent workers: what an epoch
#     boundary costs the training loop;
#   - "s3": the side-by-side S3 benchmark behind the bench server's latency
#     proxy (20 ms first byte, 100 MB/s per connection) at 0, 4, 8 and 16
#     workers, shardstream against webdataset and LitData;
#   - "decode" (not run unless named): where the batched GPU decode spends
#     its time (`gpu_decode_profile.py`), and the GPU decode pipeline with
#     no model (`--models none`: what it delivers alone), then with
#     `--no-pin-memory` (no model, and ResNet-18), about 2 minutes.
#
#   benches/gpu_figures.sh [OUT]
#
# PYTHON: the interpreter with torch, torchvision, shardstream, webdataset and
# LitData (default python3); PARTS: which parts to run (default "train
# boundary s3").
# The S3 part needs the bench server that `make bench-peers-s3` builds.
set -euo pipefail
out=${1:-bench-results}
py=${PYTHON:-python3}
parts=${PARTS:-train boundary s3}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
for part in $parts; do
    case $part in
    train)
        "$py" "$here/train_bench.py" --out "$out" --steps 30 --warmup 8 \
            --shards 64 --per-shard 250 2>&1 | tee "$out/train.log"
        ;;
    boundary)
        for kept in "" --persistent-workers; do
            "$py" "$here/train_bench.py" --out "$out/boundary$kept" --data "$out/train-data" \
                --steps 60 --warmup 8 --shards 64 --per-shard 250 --models resnet18 --workers 16 \
                --pipelines "shardstream Image" "webdataset + PIL" $kept 2>&1 |
                tee "$out/boundary$kept.log"
        done
        ;;
    s3)
        "$py" "$here/peers/peers_bench.py" --out "$out" --storage s3 \
            --first-byte-ms 20 --mbps 100 --profiles audio --workers 0 4 8 16 \
            --repeats 1 --no-cold-run \
            --libraries shardstream "shardstream (Rust batches)" webdataset litdata \
            2>&1 | tee "$out/s3.log"
        ;;
    decode)
        "$py" "$here/gpu_decode_profile.py" --data "$out/train-data" 2>&1 | tee "$out/decode.log"
        "$py" "$here/train_bench.py" --out "$out/decode" --data "$out/train-data" \
            --steps 30 --warmup 8 --shards 64 --per-shard 250 --models none --workers 4 \
            --pipelines "shardstream GPU decode" "shardstream Image" 2>&1 | tee -a "$out/decode.log"
        "$py" "$here/train_bench.py" --out "$out/decode-unpinned" --data "$out/train-data" \
            --steps 30 --warmup 8 --shards 64 --per-shard 250 --models none resnet18 --workers 4 \
            --no-pin-memory --pipelines "shardstream GPU decode" 2>&1 | tee -a "$out/decode.log"
        ;;
    *)
        echo "gpu_figures.sh: unknown part $part (train, boundary, s3, decode)" >&2
        exit 2
        ;;
    esac
done
