//! Micro benchmarks of shardstream's CPU-bound stages, with no I/O but the
//! page cache:
//!
//! - `tar_parse`: `format::tar::read_samples` over ~64 MB in-memory tars of
//!   audio-like samples (80 KB `.wav` + 200 B `.json`) and of small samples
//!   (200 B `.txt` + `.cls`); throughput in tar bytes.
//! - `shuffle_buffer`: 1M small samples pushed through a 1000-sample
//!   `ShuffleBuffer` and drained; throughput in samples.
//! - `plan_epoch`: 1M shards planned for 8 ranks x 4 workers, bytes-balanced
//!   (sizes only) and equal-length cut (sample counts); throughput in shards.
//! - `collate`: 32 samples with a 224x224x3 `uint8` array, an int and 200
//!   bytes; throughput in payload bytes.
//! - `decode`: `rgb8` on a 256x256 JPEG, `audio` on a 4 s 16 kHz 16-bit mono
//!   WAV, `json` on a 200 B document; throughput in encoded input bytes (the
//!   time per iteration is the time per field).
//! - `python_handoff`: samples into the Python objects `__next__` returns, in
//!   an embedded interpreter: one audio-like or small sample into a dict, and
//!   32 samples collated into a dict of lists; throughput in samples.
//! - `local_read`: why local shards are mapped: a 256 MiB file in the page
//!   cache read a 1 MiB chunk at a time, each byte summed, through a mapping
//!   of each chunk (`populate`, as the local reader maps them) against
//!   `pread` into a fresh buffer per chunk (what reading without mappings
//!   costs: the copy, and the pages of the buffers). The last 32 chunks are
//!   kept, as samples in flight keep theirs in the read-ahead; throughput
//!   in bytes.
//!
//! Run with `make bench-micro`, or:
//!
//! ```text
//! cargo bench --features python --bench micro -- --warm-up-time 1 --measurement-time 3
//! ```
//!
//! (the bench profile inherits the release profile and `--features python`
//! keeps dependency features as in `make test`, so its dependencies are
//! reused; pyo3, numpy and the crate rebuild after `maturin develop`).

use std::hint::black_box;
use std::io::Cursor;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use pyo3::types::PyDictMethods;
use pyo3::Python;

use shardstream::collate::collate;
use shardstream::decode::Decoder;
use shardstream::format::tar::read_samples;
use shardstream::format::Outcome;
use shardstream::format::ShardRef;
use shardstream::plan::order::rng_for;
use shardstream::plan::{plan_epoch, PlanParams, Purpose, Remainder, ShardInfo};
use shardstream::python::convert::{batch_to_dict, sample_to_dict, BytesOut, NameCache};
use shardstream::shuffle::{ShuffleBounds, ShuffleBuffer};
use shardstream::{Array, ArrayData, Sample, SampleId, Value};

/// Target size of each in-memory tar.
const TAR_BYTES: usize = 64 << 20;

/// Deterministic pseudo-random bytes (xorshift), so payloads are not runs
/// of one byte.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

/// A tar of samples `key.ext` for each `(ext, payload)`, until it holds
/// about `target` bytes.
fn build_tar(fields: &[(&str, Vec<u8>)], target: usize) -> (Vec<u8>, u64) {
    let mut builder = tar::Builder::new(Vec::with_capacity(target + (1 << 20)));
    let mut samples = 0u64;
    while builder.get_ref().len() < target {
        for (ext, data) in fields {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_mtime(1_700_000_000);
            header.set_entry_type(tar::EntryType::Regular);
            let path = format!("train/sample{samples:08}.{ext}");
            builder
                .append_data(&mut header, path, data.as_slice())
                .expect("in-memory tar");
        }
        samples += 1;
    }
    (builder.into_inner().expect("in-memory tar"), samples)
}

fn bench_tar(c: &mut Criterion) {
    let url: Arc<str> = Arc::from("mem://bench.tar");
    let json = format!(
        "{{\"speaker\": \"spk_0042\", \"text\": \"{}\", \"duration\": 2.56}}",
        "a".repeat(140)
    );
    let audio = [("wav", noise(80 * 1024, 1)), ("json", json.into_bytes())];
    let small = [("txt", noise(200, 2)), ("cls", b"7".to_vec())];
    let mut group = c.benchmark_group("tar_parse");
    group.sample_size(10);
    for (name, fields) in [("wav80k_json200", &audio[..]), ("txt200_cls", &small[..])] {
        let (tar, expected) = build_tar(fields, TAR_BYTES);
        let shard = ShardRef::whole(0, url.clone());
        let read = |bytes: &[u8]| {
            read_samples(&mut &*bytes, &shard, |sample| {
                black_box(sample);
                ControlFlow::Continue(())
            })
            .expect("valid tar")
        };
        assert_eq!(read(&tar), Outcome::Completed { samples: expected });
        group.throughput(Throughput::Bytes(tar.len() as u64));
        group.bench_function(name, |b| b.iter(|| read(black_box(&tar))));
    }
    group.finish();
}

/// A small sample: a key and one `cls` field.
fn small_sample(index: u64, url: &Arc<str>) -> Sample {
    Sample {
        id: SampleId { shard: 0, index },
        key: format!("s{index:07}"),
        url: url.clone(),
        fields: vec![("cls".to_owned(), Value::Int(index as i64 % 1000))],
        offset: index * 1024,
        length: 1024,
    }
}

fn bench_shuffle(c: &mut Criterion) {
    const N: u64 = 1_000_000;
    let url: Arc<str> = Arc::from("mem://bench.tar");
    let mut group = c.benchmark_group("shuffle_buffer");
    group.sample_size(20);
    group.throughput(Throughput::Elements(N));
    group.bench_function("1M_samples_buffer_1000", |b| {
        // The samples move from `pool` through the buffer into `out` and
        // back, so the timed loop neither allocates nor frees a sample.
        let mut pool: Vec<Sample> = (0..N).map(|i| small_sample(i, &url)).collect();
        let mut out: Vec<Sample> = Vec::with_capacity(pool.len());
        let mut seed = 0;
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                seed += 1;
                let rng = rng_for(seed, 0, Purpose::ShuffleBuffer { slot: 0 });
                let bounds = ShuffleBounds {
                    max_items: 1000,
                    max_bytes: usize::MAX,
                    initial: 100,
                };
                let mut buffer = ShuffleBuffer::new(bounds, rng, 0);
                let start = Instant::now();
                for sample in pool.drain(..) {
                    let _ = buffer.push(sample, |evicted| {
                        out.push(evicted.item);
                        ControlFlow::Continue(())
                    });
                }
                while let Some((_, sample)) = buffer.pop_random() {
                    out.push(sample);
                }
                total += start.elapsed();
                assert_eq!(out.len(), N as usize);
                std::mem::swap(&mut pool, &mut out);
            }
            total
        });
    });
    group.finish();
}

fn bench_plan(c: &mut Criterion) {
    const SHARDS: u64 = 1_000_000;
    let params = PlanParams {
        seed: 42,
        epoch: 3,
        shuffle_shards: true,
        world_size: 8,
        num_workers: 4,
        remainder: Remainder::Drop,
    };
    let jitter = |i: u64| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) % 1000;
    let by_size: Vec<ShardInfo> = (0..SHARDS)
        .map(|i| ShardInfo {
            size: Some((500 + jitter(i)) << 20),
            samples: None,
        })
        .collect();
    let by_count: Vec<ShardInfo> = (0..SHARDS)
        .map(|i| ShardInfo {
            size: Some((500 + jitter(i)) << 20),
            samples: Some(5000 + jitter(i)),
        })
        .collect();
    let mut group = c.benchmark_group("plan_epoch");
    group.sample_size(10);
    group.throughput(Throughput::Elements(SHARDS));
    for (name, shards) in [
        ("1M_shards_bytes_balanced", &by_size),
        ("1M_shards_sample_counts", &by_count),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| plan_epoch(black_box(shards), black_box(&params)))
        });
    }
    group.finish();
}

fn bench_collate(c: &mut Criterion) {
    const BATCH: u64 = 32;
    let url: Arc<str> = Arc::from("mem://bench.tar");
    let pixels = 224 * 224 * 3;
    let samples: Vec<Sample> = (0..BATCH)
        .map(|i| {
            let image = Array::new(vec![224, 224, 3], ArrayData::U8(noise(pixels, i)))
                .expect("shape matches");
            Sample {
                id: SampleId { shard: 0, index: i },
                key: format!("sample{i:08}"),
                url: url.clone(),
                fields: vec![
                    ("jpg".to_owned(), Value::Array(image)),
                    ("cls".to_owned(), Value::Int(i as i64)),
                    ("json".to_owned(), Value::from(noise(200, i + 100))),
                ],
                offset: 0,
                length: 0,
            }
        })
        .collect();
    let mut group = c.benchmark_group("collate");
    group.throughput(Throughput::Bytes(BATCH * (pixels as u64 + 8 + 200)));
    group.bench_function("32x_rgb224_int_bytes200", |b| {
        b.iter_batched(
            || samples.clone(),
            |samples| collate(samples, false).expect("collates"),
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

fn jpeg_256() -> Vec<u8> {
    let (width, height) = (256u32, 256u32);
    let grain = noise((width * height) as usize, 7);
    let mut pixels = Vec::with_capacity((width * height * 3) as usize);
    for y in 0..height {
        for x in 0..width {
            let g = grain[(y * width + x) as usize] / 8;
            pixels.extend_from_slice(&[x as u8 / 2 + g, y as u8 / 2 + g, (x ^ y) as u8 / 2 + g]);
        }
    }
    shardstream::augment::jpeg::encode(&pixels, width, height, false, 90).expect("JPEG encodes")
}

fn wav_4s_16k() -> Vec<u8> {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 16_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut cursor = Cursor::new(Vec::new());
    let mut writer = hound::WavWriter::new(&mut cursor, spec).expect("WAV header");
    for (i, n) in noise(4 * 16_000, 3).into_iter().enumerate() {
        let tone = (i as f32 * 440.0 * std::f32::consts::TAU / 16_000.0).sin() * 12_000.0;
        writer
            .write_sample(tone as i16 + i16::from(n as i8))
            .expect("WAV sample");
    }
    writer.finalize().expect("WAV finalize");
    cursor.into_inner()
}

fn json_200() -> Vec<u8> {
    let doc = br#"{"key": "sample00001234", "speaker": "spk_0042", "duration": 3.9875, "sample_rate": 16000, "labels": [3, 17, 42, 256], "text": "the quick brown fox jumps over the lazy dog by the river", "ok": true}"#;
    doc.to_vec()
}

fn bench_decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode");
    for (name, decoder, input) in [
        ("rgb8_jpeg_256x256", Decoder::Rgb8, jpeg_256()),
        ("audio_wav_4s_16k_i16", Decoder::Audio, wav_4s_16k()),
        ("json_200B", Decoder::Json, json_200()),
    ] {
        decoder.decode(input.clone()).expect("decodes");
        group.throughput(Throughput::Bytes(input.len() as u64));
        group.bench_function(name, |b| {
            b.iter_batched(
                || input.clone(),
                |bytes| decoder.decode(bytes),
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

/// A sample of raw bytes fields, as the tar reader produces it.
fn bytes_sample(index: u64, url: &Arc<str>, fields: &[(&str, Vec<u8>)]) -> Sample {
    Sample {
        id: SampleId { shard: 0, index },
        key: format!("train/sample{index:08}"),
        url: url.clone(),
        fields: fields
            .iter()
            .map(|(ext, data)| ((*ext).to_owned(), Value::from(data.clone())))
            .collect(),
        offset: index * 1024,
        length: 1024,
    }
}

fn bench_handoff(c: &mut Criterion) {
    const BATCH: u64 = 32;
    let url: Arc<str> = Arc::from("file:///data/shard-000000.tar");
    let audio = [("wav", noise(80 * 1024, 4)), ("json", noise(200, 5))];
    let small = [("txt", noise(200, 6)), ("cls", b"7".to_vec())];
    Python::initialize();
    // One cache for the run, as one stream keeps one.
    let mut names = NameCache::default();
    let mut group = c.benchmark_group("python_handoff");
    for (name, fields) in [("wav80k_json200", &audio[..]), ("txt200_cls", &small[..])] {
        let one = bytes_sample(0, &url, fields);
        group.throughput(Throughput::Elements(1));
        group.bench_function(format!("sample_dict_{name}"), |b| {
            Python::attach(|py| {
                b.iter_batched(
                    || one.clone(),
                    |sample| {
                        sample_to_dict(py, sample, BytesOut::Plain, &mut names)
                            .map(|dict| dict.len())
                    },
                    BatchSize::SmallInput,
                )
            })
        });
        let batch: Vec<Sample> = (0..BATCH).map(|i| bytes_sample(i, &url, fields)).collect();
        group.throughput(Throughput::Elements(BATCH));
        group.bench_function(format!("batch32_dict_{name}"), |b| {
            Python::attach(|py| {
                b.iter_batched(
                    || batch.clone(),
                    |samples| {
                        batch_to_dict(
                            py,
                            collate(samples, false).expect("collates"),
                            BytesOut::Plain,
                            &mut names,
                        )
                        .map(|dict| dict.len())
                    },
                    BatchSize::SmallInput,
                )
            })
        });
    }
    group.finish();
}

/// Size of the file `local_read` reads.
const LOCAL_FILE_BYTES: usize = 256 << 20;
/// The local reader's chunk (the default `chunk_bytes`).
const LOCAL_CHUNK_BYTES: usize = 1 << 20;
/// Chunks kept alive, as samples in flight keep theirs.
const LOCAL_CHUNKS_HELD: usize = 32;

/// Reads the file a chunk at a time with `read`, summing every byte and
/// keeping the last [`LOCAL_CHUNKS_HELD`] chunks alive.
fn read_chunks<T: std::ops::Deref<Target = [u8]>>(read: impl Fn(u64) -> T) -> u64 {
    let mut held = std::collections::VecDeque::with_capacity(LOCAL_CHUNKS_HELD);
    let mut sum = 0u64;
    for offset in (0..LOCAL_FILE_BYTES).step_by(LOCAL_CHUNK_BYTES) {
        let chunk = read(offset as u64);
        sum = sum.wrapping_add(touch(&chunk));
        if held.len() == LOCAL_CHUNKS_HELD {
            held.pop_front();
        }
        held.push_back(chunk);
    }
    sum
}

/// The wrapping sum of `bytes` as little-endian 8-byte words: every byte
/// read, as a consumer would.
fn touch(bytes: &[u8]) -> u64 {
    bytes
        .chunks_exact(8)
        .map(|word| u64::from_le_bytes(word.try_into().expect("8 bytes")))
        .fold(0, u64::wrapping_add)
}

fn bench_local_read(c: &mut Criterion) {
    use std::os::unix::fs::FileExt;
    let dir = std::env::temp_dir().join(format!("shardstream-micro-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("local-read.bin");
    std::fs::write(&path, noise(LOCAL_FILE_BYTES, 7)).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let mut group = c.benchmark_group("local_read");
    group.throughput(Throughput::Bytes(LOCAL_FILE_BYTES as u64));
    group.sample_size(10);
    group.bench_function("mmap_1MiB_chunks", |b| {
        b.iter(|| {
            read_chunks(|offset| {
                // SAFETY: the file is this benchmark's own, in a directory
                // named for this process, and nothing changes it while it
                // is mapped.
                unsafe {
                    memmap2::MmapOptions::new()
                        .offset(offset)
                        .len(LOCAL_CHUNK_BYTES)
                        .populate()
                        .map(&file)
                }
                .unwrap()
            })
        })
    });
    group.bench_function("pread_1MiB_chunks", |b| {
        b.iter(|| {
            read_chunks(|offset| {
                let mut chunk = vec![0u8; LOCAL_CHUNK_BYTES];
                file.read_exact_at(&mut chunk, offset).unwrap();
                chunk
            })
        })
    });
    group.finish();
    std::fs::remove_dir_all(&dir).ok();
}

criterion_group!(
    benches,
    bench_tar,
    bench_shuffle,
    bench_plan,
    bench_collate,
    bench_decode,
    bench_handoff,
    bench_local_read
);
criterion_main!(benches);
