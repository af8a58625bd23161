//! Manifests, equal-length epochs, and exact and elastic resume, on real files.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::compression::Compression;
use crate::config::StreamOptions;
use crate::dataset::resolve;
use crate::manifest::{self, Manifest, ManifestChoice};
use crate::pipeline::{Event, SampleStream};
use crate::plan::{Remainder, SlotSpec};
use crate::shard::Shard;
use crate::state::{Resume, SlotState};
use crate::stats::Counters;

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
    let s3 = crate::config::StoreOptions::default();
    crate::index::index_dataset(
        &urls,
        crate::spec::DatasetFormat::Tar,
        &out,
        &s3,
        2,
        None,
        &crate::index::Silent,
    )
    .unwrap();
    let mut shards = resolve::resolve(&urls).unwrap();
    let attached = manifest::attach(&mut shards, &ManifestChoice::Auto).unwrap();
    assert_eq!(attached.used, Some(out.display().to_string()));
    shards
}

fn options(buffer: usize, remainder: Remainder) -> StreamOptions {
    StreamOptions::builder()
        .with_seed(7)
        .with_shuffle_buffer(buffer)
        .with_read_ahead_bytes(Some(64 << 10))
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
    let plain = resolve::resolve(&write_dataset(dir.path(), &[3, 40, 0, 17, 9, 25])).unwrap();
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
                    bytes += counters.snapshot().get(crate::stats::Counter::BytesRead);
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
    shards = resolve::resolve(&[shards[0].url.clone(), path.clone()]).unwrap();
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
                resolve::resolve(&write_dataset(dir.path(), &counts)).unwrap()
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

/// Damaged, edited and mismatched states: each is refused before any read
/// with a `StateMismatch` naming the field, never a panic, a repeated
/// sample or a shorter epoch.
mod damaged_states {
    use super::*;
    use crate::state::Cursor;
    use crate::Error;

    const COUNTS: [usize; 5] = [7, 19, 0, 12, 5];

    fn refused(
        shards: &[Shard],
        options: &StreamOptions,
        slot: SlotSpec,
        resume: Resume,
    ) -> String {
        match SampleStream::new(
            shards,
            options,
            2,
            slot,
            Arc::new(Counters::new()),
            Some(resume),
        ) {
            Err(Error::StateMismatch(message)) => format!("state does not match: {message}"),
            Err(other) => panic!("expected a state mismatch, got {other}"),
            Ok(_) => panic!("the state was accepted"),
        }
    }

    fn exact_refused(
        shards: &[Shard],
        options: &StreamOptions,
        slot: SlotSpec,
        state: SlotState,
    ) -> String {
        refused(shards, options, slot, Resume::Exact(state))
    }

    /// A 1 x 1 slot's state after `k` samples, and the keys handed out.
    fn saved_after(
        shards: &[Shard],
        options: &StreamOptions,
        slot: SlotSpec,
        k: usize,
    ) -> (SlotState, Vec<String>) {
        let mut stream = start(shards, options, slot, None);
        let head: Vec<String> = std::iter::from_fn(|| next_key(&mut stream))
            .take(k)
            .collect();
        (
            SlotState::from_json(&stream.state().to_json()).unwrap(),
            head,
        )
    }

    fn assert_names(message: &str, field: &str) {
        assert!(
            message.contains(&format!("state field {field}")),
            "{message}"
        );
    }

    #[test]
    fn exact_state_fields_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let shards = indexed(dir.path(), &COUNTS);
        let options = options(6, Remainder::Drop);
        let slot = SlotSpec::new(1, 0, 1, 0).unwrap();
        let (good, head) = saved_after(&shards, &options, slot, 10);
        assert_eq!(good.buffer.len(), 5, "one out of a full buffer");
        let units = start(&shards, &options, slot, None).units().len();
        let produced: Vec<(u64, u64)> = head
            .iter()
            .map(|key| {
                let (s, i) = key.trim_start_matches('s').split_once('/').unwrap();
                (s.parse().unwrap(), i.parse().unwrap())
            })
            .collect();
        let edit = |f: &dyn Fn(&mut SlotState)| {
            let mut state = good.clone();
            f(&mut state);
            exact_refused(&shards, &options, slot, state)
        };
        let message = edit(&|s| s.buffer[3] = [17, 0]);
        assert!(
            message.contains("state field buffer[3]: shard 17 is not below the dataset's 5 shards"),
            "{message}"
        );
        assert_names(&edit(&|s| s.buffer[0] = [1, 19]), "buffer[0]");
        assert_names(&edit(&|s| s.buffer[0] = [1, u64::MAX]), "buffer[0]");
        assert_names(&edit(&|s| s.buffer[1] = s.buffer[0]), "buffer[1]");
        // A sample the cursor has not reached yet would come twice.
        let mut not_yet = good.clone();
        let last = not_yet.cursor.next_sample.unwrap();
        let shard = not_yet.buffer[0][0];
        not_yet.buffer[0] = [shard, last];
        assert_names(
            &exact_refused(&shards, &options, slot, not_yet),
            "buffer[0]",
        );
        // A sample already handed out, in place of a held one, would come
        // twice and the held one never: the digest tells.
        let (s, i) = produced[0];
        assert_names(&edit(&|st| st.buffer[2] = [s, i]), "digest");
        assert_names(&edit(&|s| s.buffer.push(s.buffer[0])), "buffer");
        assert_names(&edit(&|s| s.buffer.pop().map_or((), drop)), "produced");
        assert_names(&edit(&|s| s.cursor.unit = units + 1), "cursor.unit");
        assert_names(&edit(&|s| s.cursor.unit = usize::MAX), "cursor.unit");
        assert_names(
            &edit(&|s| {
                s.cursor = Cursor {
                    unit: units,
                    next_sample: Some(1),
                }
            }),
            "cursor.next_sample",
        );
        assert_names(
            &edit(&|s| s.cursor.next_sample = Some(0)),
            "cursor.next_sample",
        );
        assert_names(
            &edit(&|s| s.cursor.next_sample = Some(u64::MAX)),
            "cursor.next_sample",
        );
        assert_names(&edit(&|s| s.produced += 1), "produced");
        assert_names(&edit(&|s| s.produced = 10_000), "produced");
        assert_names(&edit(&|s| s.skipped = 1), "produced");
        assert_names(
            &edit(&|s| s.rng_word_pos = "99999999999".into()),
            "rng_word_pos",
        );
        assert_names(&edit(&|s| s.rng_word_pos = "0".into()), "rng_word_pos");
        assert_names(&edit(&|s| s.rng_word_pos = "-1".into()), "rng_word_pos");
        assert_names(&edit(&|s| s.digest = "0000000000000000".into()), "digest");
        assert_names(&edit(&|s| s.digest = "zz".into()), "digest");
        assert_names(&edit(&|s| s.finished = true), "finished");
        assert_names(
            &edit(&|s| s.resumed_from = Some(Vec::new())),
            "resumed_from",
        );
        assert_names(
            &edit(&|s| s.fingerprint = "0123456789abcdef".into()),
            "fingerprint",
        );
        assert_names(&edit(&|s| s.world_size = 2), "world_size");
        assert_names(&edit(&|s| s.num_workers = 3), "num_workers");
        assert_names(&edit(&|s| s.rank = 1), "rank");
        assert_names(&edit(&|s| s.worker_id = 1), "worker_id");
        // Without a shuffle buffer, a state that holds samples is refused.
        let unshuffled = StreamOptions {
            shuffle_buffer: 0,
            ..options.clone()
        };
        let (plain, _) = saved_after(&shards, &unshuffled, slot, 4);
        let mut holding = plain.clone();
        holding.buffer.push([1, 0]);
        assert_names(
            &exact_refused(&shards, &unshuffled, slot, holding),
            "buffer",
        );
        // The good state itself resumes.
        let rest = all_keys(&mut start(
            &shards,
            &options,
            slot,
            Some(Resume::Exact(good)),
        ));
        let full = all_keys(&mut start(&shards, &options, slot, None));
        assert_eq!([head, rest].concat(), full);
    }

    #[test]
    fn a_finished_state_with_held_samples_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let shards = indexed(dir.path(), &COUNTS);
        let options = options(6, Remainder::Drop);
        let slot = SlotSpec::new(1, 0, 1, 0).unwrap();
        let mut stream = start(&shards, &options, slot, None);
        all_keys(&mut stream);
        let mut done = stream.state();
        assert!(done.finished && done.buffer.is_empty());
        done.buffer.push([1, 0]);
        assert_names(&exact_refused(&shards, &options, slot, done), "finished");
    }

    /// Without a manifest, a cursor past the end of its shard is found
    /// when the shard has been read: a `StateMismatch`, not a shorter epoch.
    #[test]
    fn without_a_manifest_a_cursor_past_the_shard_fails_when_read() {
        let dir = tempfile::tempdir().unwrap();
        let shards = resolve::resolve(&write_dataset(dir.path(), &COUNTS)).unwrap();
        let options = options(0, Remainder::Drop);
        let slot = SlotSpec::new(1, 0, 1, 0).unwrap();
        let (mut state, _) = saved_after(&shards, &options, slot, 3);
        state.cursor.next_sample = Some(1000);
        let mut stream = start(&shards, &options, slot, Some(Resume::Exact(state)));
        let error = loop {
            match stream.next() {
                Some(Ok(_)) => continue,
                Some(Err(error)) => break error,
                None => panic!("the epoch ended without an error"),
            }
        };
        assert!(matches!(error, Error::StateMismatch(_)), "{error}");
        assert!(error.to_string().contains("cursor.next_sample"), "{error}");
    }

    /// The states of a 2 x 2 job after uneven progress, and every key handed out.
    fn old_job(shards: &[Shard], options: &StreamOptions) -> (Vec<SlotState>, Vec<String>) {
        let mut states = Vec::new();
        let mut before = Vec::new();
        for (slot_index, k) in [(0, 3), (1, 7), (2, 0), (3, 5)] {
            let slot = SlotSpec::new(2, slot_index / 2, 2, slot_index % 2).unwrap();
            let (state, head) = saved_after(shards, options, slot, k);
            states.push(state);
            before.extend(head);
        }
        (states, before)
    }

    #[test]
    fn elastic_state_fields_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let shards = indexed(dir.path(), &COUNTS);
        let options = options(4, Remainder::Drop);
        let (states, _) = old_job(&shards, &options);
        assert!(states.iter().filter(|s| !s.buffer.is_empty()).count() >= 2);
        let slot = SlotSpec::new(1, 0, 3, 1).unwrap();
        let edit = |f: &dyn Fn(&mut Vec<SlotState>)| {
            let mut edited = states.clone();
            f(&mut edited);
            refused(&shards, &options, slot, Resume::Elastic(edited))
        };
        // Once a panic inside the cut; now a mismatch naming the field.
        let message = edit(&|s| s[1].buffer[0] = [17, 0]);
        assert!(
            message.contains(
                "state field slots[1].buffer[0]: shard 17 is not below the dataset's 5 shards"
            ),
            "{message}"
        );
        // Two different states of one slot (an identical copy is fine).
        let message = edit(&|s| {
            let mut other = s[1].clone();
            other.produced += 1;
            s.push(other);
        });
        assert!(
            message.contains("second, different state of rank 0 worker 1"),
            "{message}"
        );
        let mut twice = states.clone();
        twice.push(states[3].clone());
        start(&shards, &options, slot, Some(Resume::Elastic(twice)));
        assert_names(&edit(&|s| s[0].cursor.unit = 99), "slots[0].cursor.unit");
        assert_names(
            &edit(&|s| s[2].resumed_from = Some(Vec::new())),
            "slots[2].resumed_from",
        );
        assert_names(
            &edit(&|s| {
                for state in s.iter_mut() {
                    state.resumed_from = Some(Vec::new());
                }
            }),
            "slots[0].resumed_from",
        );
        // One sample in two slots' buffers.
        let message = edit(&|s| {
            let (from, to) = (
                s.iter().position(|x| !x.buffer.is_empty()).unwrap(),
                s.iter().rposition(|x| !x.buffer.is_empty()).unwrap(),
            );
            s[to].buffer[0] = s[from].buffer[0];
        });
        assert!(message.contains(".buffer[0]"), "{message}");
        assert_names(&edit(&|s| s[3].epoch += 1), "slots[3].epoch");
        assert_names(&edit(&|s| s[1].world_size = 3), "slots[1].world_size");
        assert_names(&edit(&|s| s[1].rank = 5), "slots[1].rank");
        assert_names(
            &edit(&|s| s[2].fingerprint = "0123456789abcdef".into()),
            "slots[2].fingerprint",
        );
        let message = edit(&|s| {
            s.remove(2);
        });
        assert!(
            message.contains("every one of the 2 x 2 slots")
                && message.contains("rank 1 worker 0 is missing"),
            "{message}"
        );
        // A layout too large to plan is refused by its bound, not planned.
        let message = edit(&|s| {
            for state in s.iter_mut() {
                state.world_size = usize::MAX;
            }
        });
        assert!(
            message.contains("slots[0].world_size") && message.contains("is above 1048576"),
            "{message}"
        );
        assert_names(&edit(&|s| s.clear()), "slots");
        assert_names(&edit(&|s| s[0].finished = true), "slots[0].finished");
        assert_names(&edit(&|s| s[3].produced = 0), "slots[3].produced");
    }

    #[test]
    fn nested_resumed_from_states_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let shards = indexed(dir.path(), &COUNTS);
        let options = options(4, Remainder::Drop);
        let (states, _) = old_job(&shards, &options);
        let slot = SlotSpec::new(3, 1, 1, 0).unwrap();
        let mut stream = start(&shards, &options, slot, Some(Resume::Elastic(states)));
        next_key(&mut stream);
        next_key(&mut stream);
        let good = stream.state();
        drop(stream);
        assert_eq!(good.resumed_from.as_ref().map(Vec::len), Some(4));
        let edit = |f: &dyn Fn(&mut Vec<SlotState>)| {
            let mut state = good.clone();
            f(state.resumed_from.as_mut().unwrap());
            exact_refused(&shards, &options, slot, state)
        };
        assert_names(
            &edit(&|s| s[1].buffer[0] = [40, 0]),
            "resumed_from[1].buffer[0]",
        );
        assert_names(&edit(&|s| s[1].epoch = 7), "resumed_from[1].epoch");
        assert_names(
            &edit(&|s| s[2].digest = "0000000000000001".into()),
            "resumed_from[2].digest",
        );
        start(&shards, &options, slot, Some(Resume::Exact(good)));
    }

    /// Keys of a whole slot epoch, by (slot, epoch).
    type Full = HashMap<(usize, usize, u64), Vec<String>>;

    fn full_run(
        shards: &[Shard],
        options: &StreamOptions,
        slot: SlotSpec,
        epoch: u64,
        cache: &mut Full,
    ) -> Vec<String> {
        cache
            .entry((slot.world_size * 100 + slot.num_workers, slot.slot(), epoch))
            .or_insert_with(|| {
                let mut stream = SampleStream::new(
                    shards,
                    options,
                    epoch,
                    slot,
                    Arc::new(Counters::new()),
                    None,
                )
                .unwrap();
                all_keys(&mut stream)
            })
            .clone()
    }

    fn key_counts<'a>(keys: impl IntoIterator<Item = &'a String>) -> HashMap<&'a String, usize> {
        let mut counts = HashMap::new();
        for key in keys {
            *counts.entry(key).or_default() += 1;
        }
        counts
    }

    /// A `serde_json` value's nodes, as paths of object keys and array indices.
    fn paths(value: &serde_json::Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        out.push(at.clone());
        match value {
            serde_json::Value::Object(map) => {
                for (key, child) in map {
                    at.push(key.clone());
                    paths(child, at, out);
                    at.pop();
                }
            }
            serde_json::Value::Array(items) => {
                for (i, child) in items.iter().enumerate() {
                    at.push(i.to_string());
                    paths(child, at, out);
                    at.pop();
                }
            }
            _ => {}
        }
    }

    fn node<'a>(value: &'a mut serde_json::Value, path: &[String]) -> &'a mut serde_json::Value {
        path.iter().fold(value, |v, step| match v {
            serde_json::Value::Object(map) => map.get_mut(step).unwrap(),
            serde_json::Value::Array(items) => &mut items[step.parse::<usize>().unwrap()],
            _ => unreachable!(),
        })
    }

    /// Changes one node of `value`, chosen by `pick`, in a way chosen by `how`.
    fn mutate(value: &mut serde_json::Value, pick: usize, how: u64) {
        use serde_json::{json, Value};
        let mut all = Vec::new();
        paths(value, &mut Vec::new(), &mut all);
        let path = all[pick % all.len()].clone();
        let target = node(value, &path);
        let choice = (how % 8) as usize;
        let small = how / 8 % 50;
        *target = match std::mem::take(target) {
            Value::Number(n) => {
                let v = n.as_u64().unwrap_or(0);
                [
                    json!(0),
                    json!(1),
                    json!(v.saturating_sub(1)),
                    json!(v.saturating_add(1)),
                    json!(v.saturating_mul(2)),
                    json!(u64::MAX),
                    json!(small),
                    json!(-1),
                ][choice]
                    .clone()
            }
            Value::String(s) => {
                let bumped = s
                    .parse::<u128>()
                    .map_or(s.clone(), |v| (v + 1 + small as u128 % 3).to_string());
                let mut edited = s.clone();
                edited.pop();
                edited.push(if s.ends_with('0') { '1' } else { '0' });
                [
                    String::new(),
                    edited,
                    bumped,
                    u128::MAX.to_string(),
                    "340282366920938463463374607431768211456".into(),
                    "ab".into(),
                    s.to_uppercase(),
                    small.to_string(),
                ][choice]
                    .clone()
                    .into()
            }
            Value::Bool(b) => Value::Bool(!b),
            Value::Null => json!(small),
            Value::Array(mut items) => {
                let n = items.len();
                match choice {
                    0 if n > 0 => {
                        items.remove(small as usize % n);
                    }
                    1 if n > 0 => {
                        let copy = items[small as usize % n].clone();
                        items.push(copy);
                    }
                    2 if n > 1 => items.swap(small as usize % n, (small as usize + 1) % n),
                    3 => items.clear(),
                    4 if n > 0 => {
                        let copy = items[small as usize % n].clone();
                        items[(small as usize + 1) % n] = copy;
                    }
                    _ => items.push(json!([small % 7, small])),
                }
                Value::Array(items)
            }
            Value::Object(mut map) => {
                let keys: Vec<String> = map.keys().cloned().collect();
                match choice {
                    0 | 1 if !keys.is_empty() => {
                        map.remove(&keys[small as usize % keys.len()]);
                    }
                    2 => {
                        map.insert("resumed_from".into(), json!([]));
                    }
                    3 => {
                        map.insert("resumed_from".into(), Value::Null);
                    }
                    _ => {
                        map.insert("colour".into(), json!("red"));
                    }
                }
                Value::Object(map)
            }
        };
    }

    /// Parses (possibly mutated) JSON of one state or a list of them the
    /// way the Python binding does.
    fn parse(json: &serde_json::Value, elastic: bool) -> crate::Result<Resume> {
        if elastic {
            let serde_json::Value::Array(items) = json else {
                return Err(Error::StateMismatch("not a list".into()));
            };
            let states = items
                .iter()
                .map(|v| SlotState::from_json(&v.to_string()))
                .collect::<crate::Result<Vec<_>>>()?;
            Ok(Resume::Elastic(states))
        } else {
            Ok(Resume::Exact(SlotState::from_json(&json.to_string())?))
        }
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        shards: Vec<Shard>,
        options: StreamOptions,
        /// Exact cases: the slot, its state, and the keys handed out before.
        exact: Vec<(SlotSpec, SlotState, Vec<String>)>,
        /// The elastic case: every slot's state of a 2 x 2 job, and the keys
        /// handed out before.
        elastic: (Vec<SlotState>, Vec<String>),
        /// Keys of the 2 x 2 job's whole epoch.
        old_total: usize,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let shards = indexed(dir.path(), &COUNTS);
        let options = options(4, Remainder::Drop);
        let mut exact = Vec::new();
        for (world_size, workers) in [(1, 1), (2, 2)] {
            for slot_index in 0..world_size * workers {
                let slot = SlotSpec::new(
                    world_size,
                    slot_index / workers,
                    workers,
                    slot_index % workers,
                )
                .unwrap();
                let full = all_keys(&mut start(&shards, &options, slot, None));
                for k in [
                    0,
                    1,
                    full.len() / 2,
                    full.len().saturating_sub(1),
                    full.len(),
                ] {
                    let (state, head) = saved_after(&shards, &options, slot, k);
                    exact.push((slot, state, head));
                }
                let mut done = start(&shards, &options, slot, None);
                let head = all_keys(&mut done);
                exact.push((slot, done.state(), head));
            }
        }
        let elastic = old_job(&shards, &options);
        let old_total = (0..4)
            .map(|i| {
                all_keys(&mut start(
                    &shards,
                    &options,
                    SlotSpec::new(2, i / 2, 2, i % 2).unwrap(),
                    None,
                ))
                .len()
            })
            .sum();
        Fixture {
            _dir: dir,
            shards,
            options,
            exact,
            elastic,
            old_total,
        }
    }

    fn keys_or_error(stream: &mut SampleStream) -> Vec<String> {
        std::iter::from_fn(|| {
            stream.next().map(|event| match event {
                Ok(Event::Sample(sample)) => sample.key,
                Ok(other) => panic!("unexpected event {other:?}"),
                Err(error) => panic!("a state accepted at the start failed later: {error}"),
            })
        })
        .collect()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 300, ..Default::default() })]

        /// A valid state from a real run with random fields changed is
        /// either refused at the start with a `StateMismatch`, or (when the
        /// change left a valid state) resumes to a stream in which no sample
        /// of the epoch comes twice and none is lost: never a panic.
        #[test]
        fn mutated_states_are_refused_or_harmless(
            case in 0usize..1000,
            elastic in proptest::prelude::any::<bool>(),
            mutations in proptest::collection::vec((0usize..10_000, proptest::prelude::any::<u64>()), 1..4),
        ) {
            static FIXTURE: std::sync::OnceLock<std::sync::Mutex<(Fixture, Full)>> = std::sync::OnceLock::new();
            let shared = FIXTURE.get_or_init(|| std::sync::Mutex::new((fixture(), Full::new())));
            let mut guard = shared.lock().unwrap_or_else(|e| e.into_inner());
            let (fx, cache) = &mut *guard;
            if !elastic {
                let (slot, state, head) = &fx.exact[case % fx.exact.len()];
                let mut json: serde_json::Value = serde_json::from_str(&state.to_json()).unwrap();
                for &(pick, how) in &mutations {
                    mutate(&mut json, pick, how);
                }
                let resume = match parse(&json, false) {
                    Ok(resume) => resume,
                    Err(error) => {
                        proptest::prop_assert!(matches!(error, Error::StateMismatch(_)), "{error}");
                        return Ok(());
                    }
                };
                let stream = SampleStream::new(&fx.shards, &fx.options, 2, *slot, Arc::new(Counters::new()), Some(resume));
                let mut stream = match stream {
                    Ok(stream) => stream,
                    Err(error) => {
                        proptest::prop_assert!(matches!(error, Error::StateMismatch(_)), "{error}");
                        return Ok(());
                    }
                };
                let rest = keys_or_error(&mut stream);
                let full = full_run(&fx.shards, &fx.options, *slot, stream.epoch(), cache);
                let got = key_counts(head.iter().chain(&rest));
                proptest::prop_assert_eq!(got, key_counts(&full), "accepted {}", json);
            } else {
                let (states, before) = &fx.elastic;
                let mut json = serde_json::to_value(states).unwrap();
                for &(pick, how) in &mutations {
                    mutate(&mut json, pick, how);
                }
                let resume = match parse(&json, true) {
                    Ok(resume) => resume,
                    Err(error) => {
                        proptest::prop_assert!(matches!(error, Error::StateMismatch(_)), "{error}");
                        return Ok(());
                    }
                };
                let world_size = 1 + case % 3;
                let mut after = Vec::new();
                for rank in 0..world_size {
                    let slot = SlotSpec::new(world_size, rank, 1, 0).unwrap();
                    let stream = SampleStream::new(&fx.shards, &fx.options, 0, slot, Arc::new(Counters::new()), Some(resume.clone()));
                    match stream {
                        Ok(mut stream) => after.extend(keys_or_error(&mut stream)),
                        Err(error) => {
                            proptest::prop_assert!(matches!(error, Error::StateMismatch(_)), "{error}");
                            proptest::prop_assert_eq!(rank, 0, "a state is accepted by one slot and refused by another");
                            return Ok(());
                        }
                    }
                }
                let counts = key_counts(before.iter().chain(&after));
                proptest::prop_assert!(counts.values().all(|&n| n == 1), "a sample came twice; accepted {}", json);
                let remaining = fx.old_total - before.len();
                proptest::prop_assert_eq!(after.len(), remaining / world_size * world_size, "accepted {}", json);
            }
        }
    }
}
