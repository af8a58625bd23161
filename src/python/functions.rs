//! The pure helpers exposed to Python: state checks, spec resolution,
//! plans and the command line.

use std::str::FromStr;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt};

use super::blocking::{interruptible, interruptible_stopping};
use super::errors::to_py;
use super::sample_stream::parse_resume;
use crate::dataset::resolve;
use crate::plan::{self, PlanParams, Remainder, SlotSpec};

/// Checks that `state` (JSON) is a shardstream state or list of them.
#[pyfunction]
pub fn check_state(state: &str) -> PyResult<()> {
    parse_resume(state).map(|_| ()).map_err(to_py)
}

/// Resolves dataset specs to `(url, size or None)` pairs, in order.
/// Checks a job's layout as far as it is given (`None`: known only later,
/// from `torch.distributed` or the DataLoader), once, for every caller: each
/// part an int (`TypeError` otherwise), in its range (`rank` below
/// `world_size`, `worker_id` below `num_workers` when both are given), and
/// `world_size * num_workers` within [`plan::slot::MAX_SLOTS`], so that a
/// typo is an error naming the option at construction.
#[pyfunction]
#[pyo3(signature = (*, world_size, num_workers, rank = None, worker_id = None))]
pub fn check_layout(
    world_size: Option<&Bound<'_, PyAny>>,
    num_workers: Option<&Bound<'_, PyAny>>,
    rank: Option<&Bound<'_, PyAny>>,
    worker_id: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    for (name, value) in [
        ("rank", rank),
        ("world_size", world_size),
        ("num_workers", num_workers),
        ("worker_id", worker_id),
    ] {
        if let Some(value) = value {
            if !value.is_instance_of::<PyInt>() || value.is_instance_of::<PyBool>() {
                return Err(PyTypeError::new_err(format!(
                    "invalid option {name}: expected None or an int, got {}",
                    value.repr()?
                )));
            }
        }
    }
    for (name, value, low, high) in [
        ("world_size", world_size, 1, None),
        ("num_workers", num_workers, 1, None),
        ("rank", rank, 0, world_size.map(|v| ("world_size", v))),
        (
            "worker_id",
            worker_id,
            0,
            num_workers.map(|v| ("num_workers", v)),
        ),
    ] {
        let Some(value) = value else { continue };
        let above = high.map(|(_, high)| value.ge(high)).transpose()?;
        if value.lt(low)? || above == Some(true) {
            let bound = high.map_or(String::new(), |(high_name, high)| {
                format!(" and below {high_name} {high}")
            });
            return Err(PyValueError::new_err(format!(
                "invalid option {name}: expected an int of at least {low}{bound}, got {value}"
            )));
        }
    }
    let world_size = layout_part("world_size", world_size, plan::slot::MAX_WORLD_SIZE)?;
    let num_workers = layout_part("num_workers", num_workers, plan::slot::MAX_SLOTS)?;
    // Checked against the layout when it is known (torch.distributed, the
    // DataLoader): here against the largest layout there can be.
    layout_part("rank", rank, plan::slot::MAX_WORLD_SIZE - 1)?;
    layout_part("worker_id", worker_id, plan::slot::MAX_SLOTS - 1)?;
    SlotSpec::new(world_size, 0, num_workers, 0).map_err(to_py)?;
    Ok(())
}

/// One part of a layout (1 when not given); above `most` (an int too large
/// for a `usize` included) it is refused.
fn layout_part(
    name: &'static str,
    value: Option<&Bound<'_, PyAny>>,
    most: usize,
) -> PyResult<usize> {
    let Some(value) = value else {
        return Ok(1);
    };
    match value.extract::<usize>() {
        Ok(part) if part <= most => Ok(part),
        _ => Err(to_py(crate::Error::Config {
            name,
            reason: format!("must be at most {most}, got {value}"),
        })),
    }
}

#[pyfunction]
pub fn resolve_shards(py: Python<'_>, specs: Vec<String>) -> PyResult<Vec<(String, Option<u64>)>> {
    // A listing may take long: Ctrl-C stops it, a panic is an exception.
    let shards = interruptible(py, move || resolve::resolve(&specs))?;
    Ok(shards.into_iter().map(|s| (s.url, s.size)).collect())
}

/// Validates the layout and plans one epoch of `shards`.
fn plan_slots(
    shards: Vec<plan::ShardInfo>,
    seed: u64,
    epoch: u64,
    (world_size, num_workers): (usize, usize),
    shuffle_shards: bool,
    remainder: Remainder,
) -> PyResult<Vec<Vec<plan::WorkUnit>>> {
    SlotSpec::new(world_size, 0, num_workers, 0).map_err(to_py)?;
    let params = PlanParams {
        seed,
        epoch,
        shuffle_shards,
        world_size,
        num_workers,
        remainder,
    };
    Ok(plan::plan_epoch(&shards, &params).slots)
}

/// The shard indices of every slot (`rank * num_workers + worker`) for one
/// epoch without a manifest (balanced by bytes).
#[pyfunction]
#[pyo3(signature = (sizes, *, seed, epoch, world_size, num_workers, shuffle_shards = true))]
pub fn plan_epoch(
    sizes: Vec<Option<u64>>,
    seed: u64,
    epoch: u64,
    world_size: usize,
    num_workers: usize,
    shuffle_shards: bool,
) -> PyResult<Vec<Vec<usize>>> {
    let shards = sizes
        .into_iter()
        .map(|size| plan::ShardInfo {
            size,
            samples: None,
        })
        .collect();
    let slots = plan_slots(
        shards,
        seed,
        epoch,
        (world_size, num_workers),
        shuffle_shards,
        Remainder::Drop,
    )?;
    Ok(slots
        .into_iter()
        .map(|slot| slot.into_iter().map(|u| u.shard).collect())
        .collect())
}

/// The sample runs `(shard, start, end)` of every slot for one epoch when
/// every shard's sample count is known (equal samples per rank).
#[pyfunction]
#[pyo3(signature = (counts, *, seed, epoch, world_size, num_workers, shuffle_shards = true, remainder = "drop"))]
pub fn plan_samples(
    counts: Vec<u64>,
    seed: u64,
    epoch: u64,
    world_size: usize,
    num_workers: usize,
    shuffle_shards: bool,
    remainder: &str,
) -> PyResult<Vec<Vec<(usize, u64, u64)>>> {
    let remainder = Remainder::from_str(remainder).map_err(to_py)?;
    let shards = counts
        .into_iter()
        .map(|n| plan::ShardInfo {
            size: None,
            samples: Some(n),
        })
        .collect();
    let slots = plan_slots(
        shards,
        seed,
        epoch,
        (world_size, num_workers),
        shuffle_shards,
        remainder,
    )?;
    Ok(slots
        .into_iter()
        .map(|slot| {
            slot.into_iter()
                .map(|u| {
                    let r = u.samples.unwrap_or(0..0);
                    (u.shard, r.start, r.end)
                })
                .collect()
        })
        .collect())
}

/// Runs the `shardstream` command line with `argv` (program name first):
/// its exit code; Ctrl-C raises `KeyboardInterrupt` (once `write` has
/// stopped, its open shard aborted), a panic a `ShardStreamError`.
#[pyfunction]
pub fn run_cli(py: Python<'_>, argv: Vec<String>) -> PyResult<i32> {
    interruptible_stopping(py, move || Ok(crate::cli::run(argv)), crate::cli::interrupt)
}
