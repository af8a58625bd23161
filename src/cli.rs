//! The `shardstream` command line: `inspect` a shard, print a `plan`.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use crate::config::{SlotSpec, StreamOptions};
use crate::error::Result;
use crate::pipeline::{Event, SampleStream};
use crate::plan::{self, PlanParams};
use crate::spec::{self, Shard};
use crate::stats::{Counter, Counters};

#[derive(Debug, Parser)]
#[command(
    name = "shardstream",
    version,
    about = "Inspect shards and epoch plans"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List a shard's samples: keys, fields and sizes.
    Inspect {
        /// Shard path or file:// URL.
        shard: String,
        /// Print at most this many samples (totals still cover the whole shard).
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Print which shards each (rank, worker) slot reads in an epoch.
    Plan {
        /// Dataset spec: paths, file:// URLs, brace ranges, directories.
        #[arg(required = true)]
        spec: Vec<String>,
        /// Number of processes (ranks).
        #[arg(long, default_value_t = 1)]
        world_size: usize,
        /// DataLoader workers per process.
        #[arg(long, default_value_t = 1)]
        workers: usize,
        /// Seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Epoch.
        #[arg(long, default_value_t = 0)]
        epoch: u64,
        /// Keep the listed shard order instead of shuffling it per epoch.
        #[arg(long)]
        no_shuffle: bool,
    },
}

/// Runs the CLI on `args` (program name first); returns the exit code.
pub fn run<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    let mut out = std::io::stdout().lock();
    let result = match cli.command {
        Command::Inspect { shard, limit } => inspect(&shard, limit, &mut out),
        Command::Plan {
            spec,
            world_size,
            workers,
            seed,
            epoch,
            no_shuffle,
        } => print_plan(
            &spec,
            world_size,
            workers,
            seed,
            epoch,
            !no_shuffle,
            &mut out,
        ),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn inspect(url: &str, limit: Option<usize>, out: &mut dyn Write) -> Result<()> {
    let shards = spec::resolve(&[url.to_owned()])?;
    let total = shards.iter().filter_map(|s| s.size).sum::<u64>();
    let options = StreamOptions::builder()
        .with_shuffle_shards(false)
        .with_shuffle_buffer(0)
        .build()?;
    let counters = Arc::new(Counters::new());
    let slot = SlotSpec::new(1, 0, 1, 0)?;
    let stream = SampleStream::start(&shards, &options, 0, slot, counters.clone())?;
    let progress = ProgressBar::new(total).with_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} {msg}")
            .expect("valid template"),
    );
    progress.enable_steady_tick(Duration::from_millis(200));
    let (mut samples, mut field_bytes) = (0u64, 0u64);
    for event in stream {
        match event? {
            Event::Sample(sample) => {
                samples += 1;
                let size: u64 = sample.fields.iter().map(|(_, v)| v.len() as u64).sum();
                field_bytes += size;
                if limit.is_none_or(|n| samples <= n as u64) {
                    let fields: Vec<String> = sample
                        .fields
                        .iter()
                        .map(|(name, value)| format!("{name}:{}", value.len()))
                        .collect();
                    progress.suspend(|| writeln!(out, "{}\t{}", sample.key, fields.join(" ")))?;
                }
                progress.set_position(counters.snapshot().get(Counter::BytesRead));
            }
            Event::Skipped(error) => return Err(error),
        }
    }
    progress.finish_and_clear();
    writeln!(
        out,
        "{samples} samples, {field_bytes} bytes of fields, {total} bytes in the shard"
    )?;
    Ok(())
}

fn print_plan(
    specs: &[String],
    world_size: usize,
    workers: usize,
    seed: u64,
    epoch: u64,
    shuffle_shards: bool,
    out: &mut dyn Write,
) -> Result<()> {
    SlotSpec::new(world_size, 0, workers, 0)?;
    let shards: Vec<Shard> = spec::resolve(specs)?;
    let sizes: Vec<Option<u64>> = shards.iter().map(|s| s.size).collect();
    let params = PlanParams {
        seed,
        epoch,
        shuffle_shards,
        world_size,
        num_workers: workers,
    };
    let plan = plan::plan_epoch(&sizes, &params);
    writeln!(
        out,
        "{} shards, world_size {world_size}, {workers} workers per rank, seed {seed}, epoch {epoch}; samples: unknown (no manifest)",
        shards.len()
    )?;
    for (slot, units) in plan.slots.iter().enumerate() {
        let bytes: u64 = units.iter().filter_map(|&i| shards[i].size).sum();
        let unknown = units.iter().filter(|&&i| shards[i].size.is_none()).count();
        let unknown_note = if unknown > 0 {
            format!(" (+{unknown} of unknown size)")
        } else {
            String::new()
        };
        writeln!(
            out,
            "rank {} worker {}: {} shards, {bytes} bytes{unknown_note}",
            slot / workers,
            slot % workers,
            units.len()
        )?;
        for &i in units {
            writeln!(out, "  {}", shards[i].url)?;
        }
    }
    Ok(())
}

impl From<std::io::Error> for crate::error::Error {
    fn from(e: std::io::Error) -> Self {
        crate::error::Error::Stopped(format!("cannot write output: {e}"))
    }
}
