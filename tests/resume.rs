//! Manifests, equal-length epochs, and exact and elastic resume, on real files.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use shardstream::config::{SlotSpec, StreamOptions};
use shardstream::format::Compression;
use shardstream::manifest::{self, Manifest, ManifestChoice};
use shardstream::pipeline::{Event, SampleStream};
use shardstream::plan::Remainder;
use shardstream::spec::{self, Shard};
use shardstream::state::{Resume, SlotState};
use shardstream::stats::Counters;

/// Shards of very uneven sample counts, with a skipped member now and then.
fn write_dataset(dir: &Path, counts: &[usize]) -> Vec<String> {
    write_dataset_as(dir, counts, &["tar"])
}

/// [`write_dataset`] with shard `s` written as `kinds[s % kinds.len()]`:
/// `tar`, `tar.gz` or `tar.zst`.
fn write_dataset_as(dir: &Path, counts: &[usize], kinds: &[&str]) -> Vec<String> {
    let mut urls = Vec::new();
    for (s, &n) in counts.iter().enumerate() {
        let kind = kinds[s % kinds.len()];
        let path = dir.join(format!("shard-{s:03}.{kind}"));
        let mut builder = tar::Builder::new(Vec::new());
        for i in 0..n {
            let mut members = vec![
                (
                    format!("s{s}/{i:05}.bin"),
                    vec![(i % 251) as u8; 50 + (i * 37) % 900],
                ),
                (format!("s{s}/{i:05}.txt"), format!("{s}-{i}").into_bytes()),
            ];
            if i % 7 == 3 {
                members.insert(1, (format!("s{s}/NOTES{i}"), b"skipped".to_vec()));
            }
            for (name, data) in members {
                let mut header = tar::Header::new_gnu();
                header.set_size(data.len() as u64);
                header.set_mode(0o644);
                header.set_entry_type(tar::EntryType::Regular);
                builder.append_data(&mut header, name, &data[..]).unwrap();
            }
        }
        let tar = builder.into_inner().unwrap();
        let bytes = match kind {
            "tar" => tar,
            "tar.gz" => {
                let mut encoder =
                    flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                encoder.write_all(&tar).unwrap();
                encoder.finish().unwrap()
            }
            "tar.zst" => zstd::encode_all(&tar[..], 3).unwrap(),
            other => panic!("unknown kind {other}"),
        };
        std::fs::write(&path, bytes).unwrap();
        urls.push(path.to_str().unwrap().to_owned());
    }
    urls
}

fn indexed(dir: &Path, counts: &[usize]) -> Vec<Shard> {
    indexed_as(dir, counts, &["tar"])
}

fn indexed_as(dir: &Path, counts: &[usize], kinds: &[&str]) -> Vec<Shard> {
    let urls = write_dataset_as(dir, counts, kinds);
    let out = dir.join("manifest.json");
    let mut args = vec!["shardstream".to_owned(), "index".into()];
    args.extend(urls.iter().cloned());
    args.extend(["-o".into(), out.to_str().unwrap().to_owned()]);
    assert_eq!(shardstream::cli::run(args), 0);
    let mut shards = spec::resolve(&urls).unwrap();
    let attached = manifest::attach(&mut shards, &ManifestChoice::Auto).unwrap();
    assert_eq!(attached.used.as_deref(), Some(out.as_path()));
    shards
}

fn options(buffer: usize, remainder: Remainder) -> StreamOptions {
    StreamOptions::builder()
        .with_seed(7)
        .with_shuffle_buffer(buffer)
        .with_read_ahead_bytes(64 << 10)
        .with_chunk_bytes(16 << 10)
        .with_output_queue(4)
        .with_remainder(remainder)
        .with_io_timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

fn start(
    shards: &[Shard],
    options: &StreamOptions,
    slot: SlotSpec,
    resume: Option<Resume>,
) -> SampleStream {
    SampleStream::new(shards, options, 2, slot, Arc::new(Counters::new()), resume).unwrap()
}

fn next_key(stream: &mut SampleStream) -> Option<String> {
    match stream.next()?.unwrap() {
        Event::Sample(sample) => Some(sample.key),
        Event::Skipped(error) => panic!("skipped: {error}"),
        Event::Batch(table) => panic!("unexpected Arrow batch from {}", table.url),
    }
}

fn all_keys(stream: &mut SampleStream) -> Vec<String> {
    std::iter::from_fn(|| next_key(stream)).collect()
}

/// Takes `k` samples, saves the state through JSON, resumes, and returns both parts.
fn split_at(
    shards: &[Shard],
    options: &StreamOptions,
    slot: SlotSpec,
    k: usize,
) -> (Vec<String>, Vec<String>) {
    let mut first = start(shards, options, slot, None);
    let head: Vec<String> = std::iter::from_fn(|| next_key(&mut first))
        .take(k)
        .collect();
    let state = SlotState::from_json(&first.state().to_json()).unwrap();
    drop(first);
    let mut resumed = start(shards, options, slot, Some(Resume::Exact(state)));
    (head, all_keys(&mut resumed))
}

#[test]
fn exact_resume_continues_in_the_same_order() {
    let dir = tempfile::tempdir().unwrap();
    let plain = spec::resolve(&write_dataset(dir.path(), &[3, 40, 0, 17, 9, 25])).unwrap();
    let dir2 = tempfile::tempdir().unwrap();
    let with_manifest = indexed(dir2.path(), &[3, 40, 0, 17, 9, 25]);
    for shards in [&plain, &with_manifest] {
        // (30, 3): the buffer ramps from 3 held samples up to 30.
        for (buffer, initial) in [(0, 1), (1, 1), (5, 5), (30, 30), (30, 3)] {
            let options = StreamOptions {
                shuffle_initial: initial,
                ..options(buffer, Remainder::Drop)
            };
            for (world_size, workers) in [(1, 1), (2, 2)] {
                for rank in 0..world_size {
                    for worker in 0..workers {
                        let slot = SlotSpec::new(world_size, rank, workers, worker).unwrap();
                        let full = all_keys(&mut start(shards, &options, slot, None));
                        for k in [
                            0,
                            1,
                            2,
                            full.len() / 3,
                            full.len() / 2 + 1,
                            full.len().saturating_sub(1),
                            full.len(),
                        ] {
                            let (head, rest) = split_at(shards, &options, slot, k);
                            let joined: Vec<String> = head.into_iter().chain(rest).collect();
                            assert_eq!(joined, full, "buffer {buffer}, slot {slot:?}, k {k}");
                        }
                    }
                }
            }
        }
    }
}

/// With a manifest the plan depends on sample counts only, so a dataset of
/// gzip, zstd and plain shards gives every slot the very samples, in the
/// very order, of the same dataset all plain, although its pieces of
/// compressed shards are read from the shards' starts; resume is exact.
#[test]
fn compressed_shards_with_a_manifest_match_plain_ones_and_resume_exactly() {
    let counts = [3, 40, 0, 17, 9, 25, 12];
    let (plain_dir, mixed_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let plain = indexed(plain_dir.path(), &counts);
    let mixed = indexed_as(mixed_dir.path(), &counts, &["tar.gz", "tar.zst", "tar"]);
    let recorded: Vec<_> = Manifest::load(&mixed_dir.path().join("manifest.json"))
        .unwrap()
        .shards
        .iter()
        .map(|e| e.compression)
        .collect();
    let cycle = [Some(Compression::Gzip), Some(Compression::Zstd), None];
    let expected: Vec<_> = (0..counts.len()).map(|s| cycle[s % 3]).collect();
    assert_eq!(recorded, expected);
    for buffer in [0, 5] {
        let options = options(buffer, Remainder::Drop);
        for (world_size, workers) in [(1, 1), (2, 2), (3, 1)] {
            let mut seen: HashMap<String, usize> = HashMap::new();
            for rank in 0..world_size {
                for worker in 0..workers {
                    let slot = SlotSpec::new(world_size, rank, workers, worker).unwrap();
                    let full = all_keys(&mut start(&mixed, &options, slot, None));
                    assert_eq!(full, all_keys(&mut start(&plain, &options, slot, None)));
                    for key in &full {
                        *seen.entry(key.clone()).or_default() += 1;
                    }
                    for k in [1, full.len() / 2, full.len().saturating_sub(1)] {
                        let (head, rest) = split_at(&mixed, &options, slot, k);
                        let joined: Vec<String> = head.into_iter().chain(rest).collect();
                        assert_eq!(joined, full, "buffer {buffer}, slot {slot:?}, k {k}");
                    }
                }
            }
            let total: usize = counts.iter().sum();
            assert_eq!(seen.len(), total / world_size * world_size);
            assert!(seen.values().all(|&n| n == 1));
        }
    }
}

#[test]
fn elastic_resume_over_compressed_shards() {
    let dir = tempfile::tempdir().unwrap();
    let counts = [13, 30, 5, 21];
    let shards = indexed_as(dir.path(), &counts, &["tar.zst", "tar.gz"]);
    let options = options(4, Remainder::Drop);
    let mut before = Vec::new();
    let mut states = Vec::new();
    for (slot_index, k) in [(0, 2), (1, 9), (2, 0), (3, 4)] {
        let slot = SlotSpec::new(2, slot_index / 2, 2, slot_index % 2).unwrap();
        let mut stream = start(&shards, &options, slot, None);
        before.extend(std::iter::from_fn(|| next_key(&mut stream)).take(k));
        states.push(stream.state());
    }
    let mut after = Vec::new();
    for worker in 0..3 {
        let slot = SlotSpec::new(1, 0, 3, worker).unwrap();
        let resume = Some(Resume::Elastic(states.clone()));
        after.extend(all_keys(&mut start(&shards, &options, slot, resume)));
    }
    let mut all: Vec<String> = before.into_iter().chain(after).collect();
    let produced = all.len();
    all.sort();
    all.dedup();
    assert_eq!(
        (produced, all.len()),
        (68, 68),
        "69 samples, one dropped for 2 ranks"
    );
}

#[test]
fn resuming_twice_and_from_a_finished_state() {
    let dir = tempfile::tempdir().unwrap();
    let shards = indexed(dir.path(), &[30, 12, 44]);
    let options = options(8, Remainder::Drop);
    let slot = SlotSpec::new(1, 0, 1, 0).unwrap();
    let full = all_keys(&mut start(&shards, &options, slot, None));
    let mut got = Vec::new();
    let mut resume = None;
    for take in [10, 25, 1, 1000] {
        let mut stream = start(&shards, &options, slot, resume.take());
        got.extend(std::iter::from_fn(|| next_key(&mut stream)).take(take));
        resume = Some(Resume::Exact(stream.state()));
    }
    assert_eq!(got, full);
    let Some(Resume::Exact(done)) = resume else {
        unreachable!()
    };
    assert!(done.finished || done.produced == full.len() as u64);
    let mut after_end = start(&shards, &options, slot, Some(Resume::Exact(done)));
    assert_eq!(all_keys(&mut after_end), Vec::<String>::new());
}

#[test]
fn a_state_for_other_data_or_slot_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let shards = indexed(dir.path(), &[5, 6]);
    let options = options(4, Remainder::Drop);
    let slot = SlotSpec::new(2, 0, 1, 0).unwrap();
    let mut stream = start(&shards, &options, slot, None);
    next_key(&mut stream);
    let state = stream.state();
    let other_slot = SlotSpec::new(2, 1, 1, 0).unwrap();
    let err = SampleStream::new(
        &shards,
        &options,
        2,
        other_slot,
        Arc::new(Counters::new()),
        Some(Resume::Exact(state.clone())),
    );
    assert!(err.is_err_and(|e| e.to_string().contains("rank 0 worker 0")));
    let other_seed = StreamOptions {
        seed: 8,
        ..options.clone()
    };
    let err = SampleStream::new(
        &shards,
        &other_seed,
        2,
        slot,
        Arc::new(Counters::new()),
        Some(Resume::Exact(state)),
    );
    assert!(err.is_err_and(|e| e.to_string().contains("fingerprint")));
}

#[test]
fn manifest_gives_equal_ranks_and_reads_each_byte_once() {
    let dir = tempfile::tempdir().unwrap();
    let counts = [1, 60, 2, 33, 0, 7, 90];
    let shards = indexed(dir.path(), &counts);
    let total: usize = counts.iter().sum();
    for remainder in [Remainder::Drop, Remainder::Pad] {
        for (world_size, workers) in [(2, 2), (3, 1), (4, 3), (5, 2)] {
            let options = options(6, remainder);
            let mut seen: HashMap<String, usize> = HashMap::new();
            let mut per_rank = Vec::new();
            let mut bytes = 0;
            for rank in 0..world_size {
                let mut n = 0;
                for worker in 0..workers {
                    let slot = SlotSpec::new(world_size, rank, workers, worker).unwrap();
                    let counters = Arc::new(Counters::new());
                    let mut stream =
                        SampleStream::new(&shards, &options, 2, slot, counters.clone(), None)
                            .unwrap();
                    for key in all_keys(&mut stream) {
                        *seen.entry(key).or_default() += 1;
                        n += 1;
                    }
                    bytes += counters
                        .snapshot()
                        .get(shardstream::stats::Counter::BytesRead);
                }
                per_rank.push(n);
            }
            let expected = match remainder {
                Remainder::Drop => total / world_size,
                Remainder::Pad => total.div_ceil(world_size),
            };
            assert!(
                per_rank.iter().all(|&n| n == expected),
                "{per_rank:?} {remainder:?}"
            );
            let dupes: usize = seen.values().map(|n| n - 1).sum();
            match remainder {
                Remainder::Drop => {
                    assert_eq!(dupes, 0);
                    assert_eq!(seen.len(), expected * world_size);
                    let size: u64 = shards.iter().map(|s| s.size.unwrap()).sum();
                    assert!(bytes <= size, "read {bytes} of {size} bytes");
                }
                Remainder::Pad => {
                    assert_eq!(seen.len(), total);
                    assert_eq!(dupes, expected * world_size - total);
                }
            }
        }
    }
}

#[test]
fn a_manifest_that_does_not_match_the_data_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut shards = indexed(dir.path(), &[4, 4]);
    // Same size, different content: sample boundaries no longer match.
    let path = shards[1].url.clone();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.rotate_left(512);
    std::fs::write(&path, &bytes).unwrap();
    let options = options(0, Remainder::Drop);
    let slot = SlotSpec::new(1, 0, 1, 0).unwrap();
    let mut stream = start(&shards, &options, slot, None);
    let error = loop {
        match stream.next() {
            Some(Ok(_)) => continue,
            Some(Err(error)) => break error,
            None => panic!("no error"),
        }
    };
    assert!(error.to_string().contains(&path), "{error}");
    // A resized shard is refused when the manifest is attached.
    std::fs::write(&path, &bytes[..bytes.len() - 512]).unwrap();
    shards = spec::resolve(&[shards[0].url.clone(), path.clone()]).unwrap();
    let err = manifest::attach(&mut shards, &ManifestChoice::Auto).unwrap_err();
    assert!(err.to_string().contains("manifest"), "{err}");
}

#[test]
fn elastic_resume_produces_every_remaining_sample_once() {
    let dir = tempfile::tempdir().unwrap();
    let counts = [13, 70, 5, 41, 26, 0, 33];
    let shards = indexed(dir.path(), &counts);
    let total: usize = counts.iter().sum();
    let options = options(6, Remainder::Pad);
    // Old layout: 4 ranks x 2 workers, each slot stopped at a different point.
    let (old_world, old_workers) = (4, 2);
    let mut before: Vec<String> = Vec::new();
    let mut states = Vec::new();
    for rank in 0..old_world {
        for worker in 0..old_workers {
            let slot = SlotSpec::new(old_world, rank, old_workers, worker).unwrap();
            let mut stream = start(&shards, &options, slot, None);
            let k = [0, 3, 9, 100, 1, 12, 5, 7][rank * old_workers + worker];
            before.extend(std::iter::from_fn(|| next_key(&mut stream)).take(k));
            states.push(SlotState::from_json(&stream.state().to_json()).unwrap());
        }
    }
    let old_total = total.div_ceil(old_world) * old_world;
    for (world_size, workers) in [(2, 3), (1, 1), (3, 2)] {
        let mut after: Vec<String> = Vec::new();
        let mut per_rank = Vec::new();
        for rank in 0..world_size {
            let mut n = 0;
            for worker in 0..workers {
                let slot = SlotSpec::new(world_size, rank, workers, worker).unwrap();
                let mut stream = start(
                    &shards,
                    &options,
                    slot,
                    Some(Resume::Elastic(states.clone())),
                );
                let keys = all_keys(&mut stream);
                n += keys.len();
                after.extend(keys);
            }
            per_rank.push(n);
        }
        let remaining = old_total - before.len();
        let padded = remaining.div_ceil(world_size) * world_size;
        assert!(
            per_rank.iter().all(|&n| n == padded / world_size),
            "{per_rank:?}"
        );
        assert_eq!(after.len(), padded);
        // Everything not yet produced comes exactly once; pads repeat remaining samples only.
        let mut count: HashMap<&String, i64> = HashMap::new();
        for key in before.iter().chain(after.iter()) {
            *count.entry(key).or_default() += 1;
        }
        let every_key_seen = count.len() == total;
        assert!(every_key_seen, "{} of {total} keys", count.len());
        let extra: i64 = count.values().map(|n| n - 1).sum();
        assert_eq!(extra as usize, (old_total - total) + (padded - remaining));
    }
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// Resuming after any number of samples, with any buffer and layout,
        /// continues exactly as the uninterrupted stream.
        #[test]
        fn exact_resume_at_any_point(
            counts in prop::collection::vec(0usize..25, 1..6),
            buffer in 0usize..12,
            manifest in any::<bool>(),
            (world_size, workers) in (1usize..3, 1usize..3),
            cut in 0.0f64..1.0,
        ) {
            let dir = tempfile::tempdir().unwrap();
            let shards = if manifest {
                indexed(dir.path(), &counts)
            } else {
                spec::resolve(&write_dataset(dir.path(), &counts)).unwrap()
            };
            let options = options(buffer, Remainder::Pad);
            for rank in 0..world_size {
                for worker in 0..workers {
                    let slot = SlotSpec::new(world_size, rank, workers, worker).unwrap();
                    let full = all_keys(&mut start(&shards, &options, slot, None));
                    let k = (full.len() as f64 * cut) as usize;
                    let (head, rest) = split_at(&shards, &options, slot, k);
                    let joined: Vec<String> = head.into_iter().chain(rest).collect();
                    prop_assert_eq!(joined, full);
                }
            }
        }
    }
}
