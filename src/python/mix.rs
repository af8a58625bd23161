//! Bindings of the mixture plan ([`crate::plan::mix`]): per-slot counts and
//! orders, computed in Rust for `shardstream.Mix`.

use std::str::FromStr;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::errors::to_py;
use crate::plan::mix::{self, Policy};

/// Checks mixture weights and a policy name, naming the bad one.
#[pyfunction]
pub fn check_mix(policy: &str, weights: Vec<f64>) -> PyResult<()> {
    Policy::from_str(policy).map_err(to_py)?;
    mix::check_weights(&weights).map_err(to_py)
}

/// How many samples each stream gives a slot to which the streams' plans
/// give `available` samples, under `policy` (`"stop"`, `"restart"` or
/// `"continue"`).
#[pyfunction]
pub fn mix_counts(policy: &str, weights: Vec<f64>, available: Vec<u64>) -> PyResult<Vec<u64>> {
    let policy = Policy::from_str(policy).map_err(to_py)?;
    mix::slot_counts(policy, &weights, &available).map_err(to_py)
}

/// The order in which slot `slot` takes `counts[s]` samples of each stream
/// `s` in `epoch`: one byte per sample, the stream's index.
#[pyfunction]
#[pyo3(signature = (policy, weights, counts, *, seed, epoch, slot, generation = 0))]
#[allow(clippy::too_many_arguments)]
pub fn mix_order<'py>(
    py: Python<'py>,
    policy: &str,
    weights: Vec<f64>,
    counts: Vec<u64>,
    seed: u64,
    epoch: u64,
    slot: u32,
    generation: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    let policy = Policy::from_str(policy).map_err(to_py)?;
    let order = py
        .detach(|| mix::slot_order(policy, &weights, &counts, (seed, epoch), slot, generation))
        .map_err(to_py)?;
    Ok(PyBytes::new(py, &order))
}
