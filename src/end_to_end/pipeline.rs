//! End-to-end tests of the pipeline on real files: exactly-once across
//! slots, determinism, the read-ahead budget, error policies and bounded waits.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{OnError, StreamOptions};
use crate::dataset::resolve;
use crate::pipeline::{Event, SampleStream};
use crate::plan::SlotSpec;
use crate::shard::Shard;
use crate::state::SkippedSamples;
use crate::stats::{Counter, Counters};
use crate::Error;

/// Appends a regular file `name` holding `data`.
fn append_member(builder: &mut tar::Builder<std::fs::File>, name: &str, data: &[u8]) {
    let mut header = tar::Header::new_ustar();
    header.set_size(data.len() as u64);
    header.set_mode(0o644);
    header.set_entry_type(tar::EntryType::Regular);
    builder.append_data(&mut header, name, data).unwrap();
}

/// Writes a tar of `samples` samples with fields `bin` (`size` bytes) and `txt`.
fn write_shard(path: &Path, tag: &str, samples: usize, size: usize) {
    let mut builder = tar::Builder::new(std::fs::File::create(path).unwrap());
    for i in 0..samples {
        for (field, data) in [
            ("bin", vec![(i % 251) as u8; size]),
            ("txt", format!("{tag}-{i}").into_bytes()),
        ] {
            append_member(&mut builder, &format!("{tag}/{i:05}.{field}"), &data);
        }
    }
    builder.finish().unwrap();
}

fn dataset(dir: &Path, shards: usize, samples: usize) -> Vec<Shard> {
    for s in 0..shards {
        write_shard(
            &dir.join(format!("s-{s:03}.tar")),
            &format!("s{s}"),
            samples,
            100,
        );
    }
    resolve::resolve(&[dir.to_str().unwrap().to_owned()]).unwrap()
}

fn options() -> crate::config::StreamOptionsBuilder {
    StreamOptions::builder()
        .with_shuffle_buffer(16)
        .with_io_timeout(Duration::from_secs(20))
}

fn collect(shards: &[Shard], options: &StreamOptions, epoch: u64, slot: SlotSpec) -> Vec<String> {
    let stream = SampleStream::new(
        shards,
        options,
        epoch,
        slot,
        Arc::new(Counters::new()),
        None,
    )
    .unwrap();
    stream
        .map(|event| match event.unwrap() {
            Event::Sample(sample) => sample.key,
            Event::Skipped(error) => panic!("unexpected skip: {error}"),
            Event::Batch(table) => panic!("unexpected Arrow batch from {}", table.url),
        })
        .collect()
}

#[test]
fn every_sample_once_across_slots_and_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    let shards = dataset(dir.path(), 7, 9);
    let options = options().with_seed(11).build().unwrap();
    for (world_size, workers) in [(1, 1), (2, 2), (3, 1), (4, 3)] {
        let mut seen: HashMap<String, usize> = HashMap::new();
        for rank in 0..world_size {
            for worker in 0..workers {
                let slot = SlotSpec::new(world_size, rank, workers, worker).unwrap();
                let keys = collect(&shards, &options, 1, slot);
                assert_eq!(
                    keys,
                    collect(&shards, &options, 1, slot),
                    "not deterministic"
                );
                for key in keys {
                    *seen.entry(key).or_default() += 1;
                }
            }
        }
        assert_eq!(seen.len(), 7 * 9, "world {world_size} x {workers}");
        assert!(seen.values().all(|&n| n == 1));
    }
    let one = SlotSpec::new(1, 0, 1, 0).unwrap();
    assert_ne!(
        collect(&shards, &options, 1, one),
        collect(&shards, &options, 2, one)
    );
}

#[test]
fn read_ahead_stays_within_its_budget() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.tar");
    let member = 100 * 1024;
    write_shard(&path, "big", 200, member);
    let shards = resolve::resolve(&[path.to_str().unwrap().to_owned()]).unwrap();
    let (budget, chunk) = (1 << 20, 64 << 10);
    let options = options()
        .with_shuffle_buffer(0)
        .with_output_queue(1)
        .with_read_ahead_bytes(Some(budget))
        .with_chunk_bytes(chunk)
        .build()
        .unwrap();
    let counters = Arc::new(Counters::new());
    let slot = SlotSpec::new(1, 0, 1, 0).unwrap();
    let stream = SampleStream::new(&shards, &options, 0, slot, counters.clone(), None).unwrap();
    // Bytes per sample in the tar: two headers, the padded data and the text.
    let per_sample = (512 + member.div_ceil(512) * 512 + 1024) as u64;
    let mut consumed = 0u64;
    for event in stream {
        assert!(matches!(event.unwrap(), Event::Sample(_)));
        consumed += 1;
        std::thread::sleep(Duration::from_millis(2));
        let read = counters.snapshot().get(Counter::BytesRead);
        // The parser holds at most the queue, the sample being built and the
        // one parsed ahead; beyond that only the budget may be in flight, and
        // the chunk being parsed (a local file's is mapped: up to
        // MAP_CHUNK_BYTES, within the budget).
        let parsed = chunk.max(crate::store::local::MAP_CHUNK_BYTES.min(budget));
        let bound = (consumed + 3) * per_sample + budget as u64 + parsed as u64;
        assert!(
            read <= bound,
            "read {read} bytes after {consumed} samples (bound {bound})"
        );
    }
    assert_eq!(consumed, 200);
    assert_eq!(
        counters.snapshot().get(Counter::BytesRead),
        shards[0].size.unwrap()
    );
}

fn bad_dataset(dir: &Path) -> (Vec<Shard>, PathBuf) {
    let mut shards = dataset(dir, 3, 4);
    let junk = dir.join("junk.tar");
    std::fs::write(&junk, vec![b'j'; 3000]).unwrap();
    let truncated = dir.join("cut.tar");
    write_shard(&truncated, "cut", 5, 2000);
    let bytes = std::fs::read(&truncated).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    for path in [junk.clone(), truncated, dir.join("missing.tar")] {
        let size = std::fs::metadata(&path).ok().map(|m| m.len());
        shards.push(Shard::new(path.to_str().unwrap(), size));
    }
    (shards, junk)
}

#[test]
fn warn_policy_skips_bad_shards_and_counts_them() {
    let dir = tempfile::tempdir().unwrap();
    let (shards, _) = bad_dataset(dir.path());
    let options = options().with_on_error(OnError::Warn).build().unwrap();
    let counters = Arc::new(Counters::new());
    let slot = SlotSpec::new(1, 0, 1, 0).unwrap();
    let mut stream = SampleStream::new(&shards, &options, 0, slot, counters.clone(), None).unwrap();
    let (mut good, mut skipped, mut cut_samples) = (0, Vec::new(), 0);
    let mut left_out = Vec::new();
    while let Some(event) = stream.next() {
        match event.unwrap() {
            Event::Sample(s) if s.key.starts_with("cut/") => cut_samples += 1,
            Event::Sample(_) => good += 1,
            Event::Skipped(error) => {
                skipped.push(error);
                // What the skip left out comes with it.
                let taken = stream.take_skipped();
                assert_eq!(taken.len(), 1, "{taken:?}");
                left_out.push(taken[0]);
            }
            Event::Batch(table) => panic!("unexpected Arrow batch from {}", table.url),
        }
    }
    assert_eq!(good, 12);
    assert!(cut_samples < 5, "a truncated sample was produced");
    // Counts unknown: each skip runs from the first sample not handed out
    // to the shard's end.
    left_out.sort_by_key(|s| s.shard);
    let expected = [(3, 0), (4, cut_samples), (5, 0)].map(|(shard, first)| SkippedSamples {
        shard,
        first,
        end: None,
    });
    assert_eq!(left_out, expected);
    assert_eq!(skipped.len(), 3);
    assert!(skipped.iter().any(|e| matches!(e, Error::NotFound { .. })));
    assert!(skipped
        .iter()
        .any(|e| matches!(e, Error::Format { reason, .. } if reason.contains("truncated"))));
    assert!(skipped
        .iter()
        .any(|e| matches!(e, Error::Format { reason, .. } if reason.contains("not a tar"))));
    let stats = counters.snapshot();
    assert_eq!(stats.get(Counter::ErrorsSkipped), 3);
    assert_eq!(stats.get(Counter::ShardsCompleted), 3);
}

#[test]
fn raise_policy_ends_with_an_error_naming_the_shard() {
    let dir = tempfile::tempdir().unwrap();
    let (shards, junk) = bad_dataset(dir.path());
    let only_junk: Vec<Shard> = shards
        .into_iter()
        .filter(|s| s.url == junk.to_str().unwrap())
        .collect();
    let options = options().build().unwrap();
    let slot = SlotSpec::new(1, 0, 1, 0).unwrap();
    let mut stream = SampleStream::new(
        &only_junk,
        &options,
        0,
        slot,
        Arc::new(Counters::new()),
        None,
    )
    .unwrap();
    let error = stream.next().unwrap().unwrap_err();
    let message = error.to_string();
    assert!(message.contains(junk.to_str().unwrap()), "{message}");
    assert!(message.contains("byte offset"), "{message}");
    assert!(stream.next().is_none());
}

#[test]
fn a_stalled_shard_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("stalled.tar");
    let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: creates a named pipe at a path we own; nobody ever writes to it.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let shards = vec![Shard::new(fifo.to_str().unwrap(), None)];
    let options = options()
        .with_io_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let slot = SlotSpec::new(1, 0, 1, 0).unwrap();
    let start = Instant::now();
    let mut stream =
        SampleStream::new(&shards, &options, 0, slot, Arc::new(Counters::new()), None).unwrap();
    let error = stream.next().unwrap().unwrap_err();
    assert!(matches!(error, Error::Timeout { .. }), "{error}");
    assert!(start.elapsed() < Duration::from_secs(10));
    drop(stream);
    // Let a still-blocked open finish so its thread can exit; O_NONBLOCK
    // makes this open fail instead of wait when no reader is left.
    use std::os::unix::fs::OpenOptionsExt;
    let _writer = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo);
}

/// Samples go to the consumer in groups, yet a sample that is ready never
/// waits for bytes that have not arrived: here the shard is a pipe whose
/// writer stops after the first sample (and the start of the second), and
/// that sample must still arrive.
#[test]
fn ready_samples_do_not_wait_for_storage() {
    use crate::pipeline::Poll;
    use std::io::Write;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pipe.tar");
    let made = std::process::Command::new("mkfifo")
        .arg(&path)
        .status()
        .unwrap();
    assert!(made.success());
    let mut whole = Vec::new();
    {
        let mut builder = tar::Builder::new(&mut whole);
        for key in ["a", "b"] {
            let mut header = tar::Header::new_ustar();
            header.set_size(3);
            header.set_mode(0o644);
            header.set_entry_type(tar::EntryType::Regular);
            builder
                .append_data(&mut header, format!("{key}.txt"), &b"abc"[..])
                .unwrap();
        }
        builder.finish().unwrap();
    }
    let shards = resolve::resolve(&[path.to_str().unwrap().to_owned()]).unwrap();
    let options = StreamOptions::builder()
        .with_shuffle_buffer(0)
        .with_output_queue(64)
        .with_chunk_bytes(512)
        .with_io_timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let slot = SlotSpec::new(1, 0, 1, 0).unwrap();
    let counters = Arc::new(Counters::new());
    let mut stream = SampleStream::new(&shards, &options, 0, slot, counters, None).unwrap();
    let (first_part, rest) = whole.split_at(3 * 512);
    let (release, released) = std::sync::mpsc::channel::<()>();
    let writer = {
        let (path, first_part, rest) = (path.clone(), first_part.to_vec(), rest.to_vec());
        std::thread::spawn(move || {
            let mut pipe = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            pipe.write_all(&first_part).unwrap();
            pipe.flush().unwrap();
            released.recv_timeout(Duration::from_secs(30)).unwrap();
            pipe.write_all(&rest).unwrap();
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let first = loop {
        assert!(
            Instant::now() < deadline,
            "the first sample waited for storage"
        );
        match stream.poll(Duration::from_millis(100)).unwrap() {
            Poll::Ready(Event::Sample(sample)) => break sample,
            Poll::Pending => {}
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(first.key, "a");
    release.send(()).unwrap();
    let keys: Vec<String> = stream
        .map(|event| match event.unwrap() {
            Event::Sample(sample) => sample.key,
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(keys, ["b"]);
    writer.join().unwrap();
}

/// Members of a local (memory-mapped) shard reach the consumer as the tar
/// holds them, whether they are long enough to be shared from the mapping,
/// short enough to be copied, or cross from one chunk into the next.
#[test]
fn members_arrive_as_the_shard_holds_them_shared_or_copied() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mixed.tar");
    let sizes = [
        100usize,
        16 << 10,
        70_000,
        200_000,
        5_000,
        40_000,
        0,
        65_536,
    ];
    let mut expected = HashMap::new();
    let mut builder = tar::Builder::new(std::fs::File::create(&path).unwrap());
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for i in 0..40 {
        let key = format!("m/{i:03}");
        let mut data = vec![0u8; sizes[i % sizes.len()]];
        for byte in &mut data {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *byte = state as u8;
        }
        append_member(&mut builder, &format!("{key}.bin"), &data);
        expected.insert(key, data);
    }
    builder.finish().unwrap();
    drop(builder);
    let shards = resolve::resolve(&[path.to_str().unwrap().to_owned()]).unwrap();
    let options = options()
        .with_shuffle_buffer(8)
        .with_chunk_bytes(64 << 10)
        .with_read_ahead_bytes(Some(256 << 10))
        .build()
        .unwrap();
    let slot = SlotSpec::new(1, 0, 1, 0).unwrap();
    let stream =
        SampleStream::new(&shards, &options, 0, slot, Arc::new(Counters::new()), None).unwrap();
    let mut seen = 0;
    for event in stream {
        let Event::Sample(sample) = event.unwrap() else {
            panic!("not a sample");
        };
        let (field, value) = &sample.fields[0];
        assert_eq!(field, "bin");
        let want = &expected[&sample.key];
        assert!(
            value.as_bytes() == Some(want.as_slice()),
            "{}: {} bytes differ from the tar's {}",
            sample.key,
            value.as_bytes().map_or(0, <[u8]>::len),
            want.len()
        );
        seen += 1;
    }
    assert_eq!(seen, expected.len());
}
