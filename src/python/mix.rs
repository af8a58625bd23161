//! Bindings of the mixture plan ([`crate::plan::mix`]): per-slot counts and
//! orders, computed in Rust for `shardstream.Mix`; of its state
//! ([`crate::state::mix`]): the checks of a loaded mixture state; and
//! [`MixSlot`], one slot's mixture over its streams, fresh or resumed.

use std::str::FromStr;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyIterator};
use serde_json::{Map, Value};

use super::blocking::blocking;
use super::errors::{to_py, ShardStreamError};
use super::sample_stream::SampleStream;
use crate::error::Error;
use crate::plan::mix::{self, pass_epoch, Policy, SlotMixture, SlotPlan, MAX_PASSES, PASS_STRIDE};
use crate::state::mix::{MixCursor, MixShape, MixState, MixStream, MIX_FORMAT, MIX_VERSION};

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
    let order = blocking(py, || {
        mix::slot_order(policy, &weights, &counts, (seed, epoch), slot, generation)
    })?;
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

/// A slot of a job: `(rank, world_size, worker_id, num_workers)`.
type Slot = (u64, u64, u64, u64);

/// One slot's mixture for one epoch, fresh or resumed: its streams, its
/// plan ([`SlotPlan`]) and where it stands ([`MixCursor`]). `next()` gives
/// `(stream, sample)`; `state()` the mixture state (JSON). A stream is
/// opened with `open(stream, epoch, resume)`, which gives a
/// `SampleStream` of the slot (`resume`: the JSON of the stream's state,
/// or of every saved slot's state of it for an elastic resume).
#[pyclass(module = "shardstream._core")]
pub struct MixSlot {
    open: Py<PyAny>,
    policy: String,
    seed: u64,
    weights: Vec<f64>,
    slot: Slot,
    epoch: u64,
    generation: u64,
    /// Every slot's state of the epoch this plan was resumed from
    /// elastically, if it was.
    resumed_from: Option<Vec<MixState>>,
    cursor: MixCursor,
    /// The stream of each pass the slot is in; none once the order is done.
    streams: Vec<Py<SampleStream>>,
    /// The state at the end of the order, once it is reached.
    last_state: Option<MixState>,
}

/// What every [`MixSlot`] constructor is given.
struct Mixture<'py> {
    open: Bound<'py, PyAny>,
    streams: usize,
    policy: &'py str,
    seed: u64,
    slot: Slot,
}

impl Mixture<'_> {
    fn shape(&self) -> MixShape<'_> {
        shape(self.policy, self.seed, self.streams)
    }

    /// Opens pass `pass` over stream `s` for mixture epoch `epoch`.
    fn open(
        &self,
        s: usize,
        epoch: u64,
        pass: u64,
        resume: Option<String>,
    ) -> PyResult<Py<SampleStream>> {
        open_stream(&self.open, s, epoch, pass, resume)
    }

    /// The plan of the slot's `epoch` under `weights` (fresh, or of the
    /// rest of the epoch that `resumed_from`, every slot's state, left),
    /// with each stream's first pass opened.
    fn plan(
        &self,
        epoch: u64,
        generation: u64,
        weights: &[f64],
        resumed_from: Option<&[MixState]>,
    ) -> PyResult<(SlotPlan, Vec<Py<SampleStream>>)> {
        let py = self.open.py();
        let policy = Policy::from_str(self.policy).map_err(to_py)?;
        let (mut base, mut first, mut streams) = (vec![], vec![], vec![]);
        for s in 0..self.streams {
            let (pass, resume) = match resumed_from {
                None => (0, None),
                Some(states) => {
                    let saved: Vec<&Map<String, Value>> =
                        states.iter().map(|m| &m.streams[s].state).collect();
                    let text = serde_json::to_string(&saved)
                        .map_err(|e| to_py(Error::StateMismatch(e.to_string())))?;
                    (states[0].streams[s].pass, Some(text))
                }
            };
            let stream = self.open(s, epoch, pass, resume)?;
            first.push(planned_samples(py, &stream)?);
            base.push(pass);
            streams.push(stream);
        }
        let (rank, _, worker_id, num_workers) = self.slot;
        let index = rank
            .checked_mul(num_workers)
            .and_then(|n| n.checked_add(worker_id))
            .and_then(|n| u32::try_from(n).ok());
        let (Some(index), Ok(generation)) = (index, u32::try_from(generation)) else {
            return Err(to_py(Error::StateMismatch(
                "state field generation: out of range".into(),
            )));
        };
        let mixture = SlotMixture {
            policy,
            weights,
            key: (self.seed, epoch),
            slot: index,
            generation,
        };
        let mut failed = None;
        let plan = SlotPlan::new(mixture, base, &first, |s, pass| {
            match self
                .open(s, epoch, pass, None)
                .and_then(|stream| planned_samples(py, &stream))
            {
                Ok(n) => Ok(n),
                Err(error) => {
                    failed = Some(error);
                    Err(Error::Stopped("a stream could not be opened".into()))
                }
            }
        });
        match (plan, failed) {
            (_, Some(error)) => Err(error),
            (plan, None) => Ok((plan.map_err(to_py)?, streams)),
        }
    }

    /// A [`MixSlot`] at `cursor`, reading `streams`.
    fn slot(
        self,
        epoch: u64,
        generation: u64,
        weights: Vec<f64>,
        resumed_from: Option<Vec<MixState>>,
        cursor: MixCursor,
        streams: Vec<Py<SampleStream>>,
    ) -> MixSlot {
        MixSlot {
            open: self.open.unbind(),
            policy: self.policy.to_owned(),
            seed: self.seed,
            weights,
            slot: self.slot,
            epoch,
            generation,
            resumed_from,
            cursor,
            streams,
            last_state: None,
        }
    }
}

/// Opens pass `pass` over stream `s` for mixture epoch `epoch` with `open`
/// (see [`MixSlot`]).
fn open_stream(
    open: &Bound<'_, PyAny>,
    s: usize,
    epoch: u64,
    pass: u64,
    resume: Option<String>,
) -> PyResult<Py<SampleStream>> {
    let stream_epoch = pass_epoch(epoch, pass).map_err(to_py)?;
    Ok(open.call1((s, stream_epoch, resume))?.extract()?)
}

/// The samples a slot's stream gives: a mixture needs every count.
fn planned_samples(py: Python<'_>, stream: &Py<SampleStream>) -> PyResult<u64> {
    stream.borrow(py).planned_samples().ok_or_else(|| {
        ShardStreamError::new_err("a mixture's stream planned a whole shard without its count")
    })
}

#[pymethods]
impl MixSlot {
    /// The slot's mixture of `epoch` under `weights`, from its start.
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    fn fresh(
        open: Bound<'_, PyAny>,
        streams: usize,
        policy: &str,
        seed: u64,
        slot: Slot,
        weights: Vec<f64>,
        epoch: u64,
    ) -> PyResult<Self> {
        let mixture = Mixture {
            open,
            streams,
            policy,
            seed,
            slot,
        };
        let (plan, opened) = mixture.plan(epoch, 0, &weights, None)?;
        Ok(mixture.slot(epoch, 0, weights, None, MixCursor::new(plan), opened))
    }

    /// The rest of the slot's epoch from `state` (JSON), the slot's own
    /// mixture state, each of its counts checked against the plan.
    #[staticmethod]
    fn exact(
        open: Bound<'_, PyAny>,
        streams: usize,
        policy: &str,
        seed: u64,
        slot: Slot,
        state: &str,
    ) -> PyResult<Self> {
        let mixture = Mixture {
            open,
            streams,
            policy,
            seed,
            slot,
        };
        let state = MixState::parse(&parse_json(state)?, mixture.shape(), "").map_err(to_py)?;
        let saved = (
            state.rank,
            state.world_size,
            state.worker_id,
            state.num_workers,
        );
        if saved != slot {
            return Err(to_py(Error::StateMismatch(format!(
                "state field rank: the state is for rank {} worker {} of {} x {} slots, this \
                 mixture is rank {} worker {} of {} x {}; load shardstream.elastic_state(...) \
                 of every slot to resume onto another layout",
                saved.0, saved.2, saved.1, saved.3, slot.0, slot.2, slot.1, slot.3
            ))));
        }
        let (plan, _) = mixture.plan(
            state.epoch,
            state.generation,
            &state.weights,
            state.resumed_from.as_deref(),
        )?;
        let cursor = MixCursor::resume(plan, &state).map_err(to_py)?;
        let mut opened = Vec::with_capacity(streams);
        for (s, entry) in state.streams.iter().enumerate() {
            let text = serde_json::to_string(&entry.state)
                .map_err(|e| to_py(Error::StateMismatch(e.to_string())))?;
            let stream = mixture.open(s, state.epoch, entry.pass, Some(text))?;
            let expected = pass_epoch(state.epoch, entry.pass).map_err(to_py)?;
            let got = stream.borrow(mixture.open.py()).epoch();
            if got != expected {
                return Err(to_py(Error::StateMismatch(format!(
                    "state field streams[{s}].state.epoch: {got}, expected {expected}"
                ))));
            }
            opened.push(stream);
        }
        let MixState {
            epoch,
            generation,
            weights,
            resumed_from,
            ..
        } = state;
        Ok(mixture.slot(epoch, generation, weights, resumed_from, cursor, opened))
    }

    /// The rest of a job's epoch, split anew for this slot's layout:
    /// `states` (JSON) holds every slot's mixture state of the job, in any
    /// order; `weights` the weights from here on (the states' own if
    /// `None`).
    #[staticmethod]
    #[pyo3(signature = (open, streams, policy, seed, slot, states, weights = None))]
    fn elastic(
        open: Bound<'_, PyAny>,
        streams: usize,
        policy: &str,
        seed: u64,
        slot: Slot,
        states: &str,
        weights: Option<Vec<f64>>,
    ) -> PyResult<Self> {
        let mixture = Mixture {
            open,
            streams,
            policy,
            seed,
            slot,
        };
        let value = parse_json(states)?;
        let Some(list) = value.as_array().filter(|l| !l.is_empty()) else {
            return Err(to_py(Error::StateMismatch(
                "state field slots: expected every slot's state".into(),
            )));
        };
        let parsed = list
            .iter()
            .enumerate()
            .map(|(i, each)| MixState::parse(each, mixture.shape(), &format!("slots[{i}].")))
            .collect::<Result<Vec<_>, _>>()
            .map_err(to_py)?;
        // Every slot's state, of one job and one epoch, by rank then worker.
        let ordered = MixState::job_slots(parsed, weights.is_some()).map_err(to_py)?;
        let (epoch, generation) = (ordered[0].epoch, ordered[0].generation + 1);
        if generation >= PASS_STRIDE {
            return Err(to_py(Error::StateMismatch(
                "state field generation: out of range".into(),
            )));
        }
        let weights = weights.unwrap_or_else(|| ordered[0].weights.clone());
        let (plan, opened) = mixture.plan(epoch, generation, &weights, Some(&ordered))?;
        let cursor = MixCursor::new(plan);
        Ok(mixture.slot(epoch, generation, weights, Some(ordered), cursor, opened))
    }

    /// The mixture epoch.
    #[getter]
    fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The samples of the slot's order, taken or not.
    fn __len__(&self) -> usize {
        self.cursor.plan().order.len()
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next `(stream, sample)`. A stream whose pass ends early (a
    /// shard skipped under `on_error="warn"`) is counted short and the slot
    /// goes on; an exception leaves the position where it was.
    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<(usize, Py<PyAny>)>> {
        while let Some(take) = self.cursor.next() {
            let s = take.stream;
            if let Some(pass) = take.opens_pass {
                self.streams[s] = open_stream(self.open.bind(py), s, self.epoch, pass, None)?;
                self.cursor.enter_pass(s);
            }
            let next = self.streams[s]
                .bind(py)
                .as_any()
                .cast::<PyIterator>()?
                .clone()
                .next();
            match next {
                Some(Ok(sample)) => {
                    self.cursor.took(s, true);
                    return Ok(Some((s, sample.unbind())));
                }
                Some(Err(error)) => return Err(error),
                None => self.cursor.took(s, false),
            }
        }
        if self.last_state.is_none() {
            self.last_state = Some(self.current_state(py)?);
            // Threads reading ahead (under "stop") are let go.
            self.streams.clear();
        }
        Ok(None)
    }

    /// The mixture state (JSON) as of the last sample handed out.
    fn state(&self, py: Python<'_>) -> PyResult<String> {
        let state = match &self.last_state {
            Some(state) => state.clone(),
            None => self.current_state(py)?,
        };
        serde_json::to_string(&state).map_err(|e| to_py(Error::StateMismatch(e.to_string())))
    }
}

impl MixSlot {
    /// The state as of the last sample handed out, the streams' included.
    fn current_state(&self, py: Python<'_>) -> PyResult<MixState> {
        let mut streams = Vec::with_capacity(self.streams.len());
        for (s, stream) in self.streams.iter().enumerate() {
            let Ok(Value::Object(state)) = serde_json::to_value(stream.borrow(py).slot_state())
            else {
                return Err(ShardStreamError::new_err(
                    "a stream's state is not a JSON object",
                ));
            };
            let (pass, short) = self.cursor.entry(s);
            streams.push(MixStream { pass, short, state });
        }
        let (rank, world_size, worker_id, num_workers) = self.slot;
        Ok(MixState {
            format: MIX_FORMAT.to_owned(),
            version: MIX_VERSION,
            epoch: self.epoch,
            generation: self.generation,
            policy: self.policy.clone(),
            seed: self.seed,
            weights: self.weights.clone(),
            world_size,
            rank,
            num_workers,
            worker_id,
            position: self.cursor.position(),
            finished: self.cursor.finished(),
            streams,
            resumed_from: self.resumed_from.clone(),
        })
    }
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
