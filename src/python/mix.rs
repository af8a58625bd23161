//! Bindings of the mixture plan ([`crate::plan::mix`]): per-slot counts and
//! orders, computed in Rust for `shardstream.Mix`, and of its state
//! ([`crate::state::mix`]): the checks of a loaded mixture state.

use std::str::FromStr;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::errors::to_py;
use crate::error::Error;
use crate::plan::mix::{self, Policy};
use crate::state::mix::{MixShape, MixState, MAX_PASSES, MIX_FORMAT, MIX_VERSION, PASS_STRIDE};

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

/// What a mixture state must match (see [`MixShape`]).
fn shape(policy: &str, seed: u64, streams: usize) -> MixShape<'_> {
    MixShape {
        policy,
        seed,
        streams,
    }
}

/// Checks `state` (JSON) as the state of one slot of a mixture of
/// `streams` streams under `policy` and `seed`, naming the first field
/// that is wrong (after `prefix`, such as `slots[2].`) in a
/// `StateMismatchError`; the streams' own states are checked when they are
/// opened.
#[pyfunction]
#[pyo3(signature = (state, policy, seed, streams, prefix = ""))]
pub fn check_mix_state(
    state: &str,
    policy: &str,
    seed: u64,
    streams: usize,
    prefix: &str,
) -> PyResult<()> {
    let value = parse_json(state)?;
    MixState::parse(&value, shape(policy, seed, streams), prefix)
        .map(|_| ())
        .map_err(to_py)
}

/// The slot states of an elastic resume (`states`: a JSON list, in any
/// order) checked, each as [`check_mix_state`] does and together as the
/// states of one job in one epoch, and given back (JSON) ordered by rank,
/// then worker. `new_weights`: the resume sets weights of its own.
#[pyfunction]
pub fn mix_job_slots(
    states: &str,
    policy: &str,
    seed: u64,
    streams: usize,
    new_weights: bool,
) -> PyResult<String> {
    let value = parse_json(states)?;
    let Some(list) = value.as_array().filter(|l| !l.is_empty()) else {
        return Err(to_py(Error::StateMismatch(
            "state field slots: expected every slot's state".into(),
        )));
    };
    let parsed = list
        .iter()
        .enumerate()
        .map(|(i, each)| {
            MixState::parse(each, shape(policy, seed, streams), &format!("slots[{i}]."))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(to_py)?;
    let ordered = MixState::job_slots(parsed, new_weights).map_err(to_py)?;
    serde_json::to_string(&ordered).map_err(|e| to_py(Error::StateMismatch(e.to_string())))
}

/// `text` parsed as JSON, or the error of a state that is not.
fn parse_json(text: &str) -> PyResult<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| {
        to_py(Error::StateMismatch(format!(
            "not a shardstream.Mix state: not JSON data ({e})"
        )))
    })
}

/// Adds the mixture state's constants to the module: `MIX_FORMAT`,
/// `MIX_VERSION`, `MIX_PASS_STRIDE` and `MIX_MAX_PASSES`.
pub fn add_constants(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("MIX_FORMAT", MIX_FORMAT)?;
    m.add("MIX_VERSION", MIX_VERSION)?;
    m.add("MIX_PASS_STRIDE", PASS_STRIDE)?;
    m.add("MIX_MAX_PASSES", MAX_PASSES)
}
