//! The state of a `shardstream.Mix` (its JSON form is documented by
//! `schemas/mix_state.schema.json`): where a slot's mixture stands (its
//! epoch, the resume generation, its position in the slot's order) and,
//! per stream, the pass over the stream and the stream's own state (a
//! [`super::SlotState`], checked when the stream is opened). A loaded
//! mixture state is never trusted: [`MixState::parse`] checks every field
//! against the mixture before anything is planned, and
//! [`MixState::job_slots`] checks that the states of an elastic resume are
//! those of one job, naming the field that is wrong.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::plan::mix::{check_weights, Policy, SlotPlan, MAX_PASSES, PASS_STRIDE};

/// The `format` field of every mixture state.
pub const MIX_FORMAT: &str = "shardstream.mix";
/// The mixture state version this build reads and writes.
pub const MIX_VERSION: u64 = 1;

/// One stream's entry in a mixture state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixStream {
    /// The pass over the stream the slot is in.
    pub pass: u64,
    /// Samples of the pass the mixture counted but the stream did not give
    /// (a pass that ended early).
    pub short: u64,
    /// The stream's own state.
    pub state: Map<String, Value>,
}

/// A slot's mixture state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixState {
    /// [`MIX_FORMAT`].
    pub format: String,
    /// [`MIX_VERSION`].
    pub version: u64,
    /// The mixture's epoch.
    pub epoch: u64,
    /// How many elastic resumes led to this epoch's plan.
    pub generation: u64,
    /// `"stop"`, `"restart"` or `"continue"`.
    pub policy: String,
    /// The mixture's seed.
    pub seed: u64,
    /// The weights of the streams.
    pub weights: Vec<f64>,
    /// The ranks of the job.
    pub world_size: u64,
    /// The slot's rank.
    pub rank: u64,
    /// The DataLoader workers per rank.
    pub num_workers: u64,
    /// The slot's worker.
    pub worker_id: u64,
    /// Samples of the slot's order handed out.
    pub position: u64,
    /// Whether the slot's epoch is over.
    pub finished: bool,
    /// One entry per stream.
    pub streams: Vec<MixStream>,
    /// Every slot's state of the epoch this one was resumed from
    /// elastically, if it was.
    pub resumed_from: Option<Vec<MixState>>,
}

/// What a mixture state must match: the mixture's policy, seed and number
/// of streams.
#[derive(Debug, Clone, Copy)]
pub struct MixShape<'a> {
    /// The mixture's policy.
    pub policy: &'a str,
    /// The mixture's seed.
    pub seed: u64,
    /// Its number of streams.
    pub streams: usize,
}

/// The error of field `name` (after `prefix`, such as `slots[2].`).
fn bad(prefix: &str, name: &str, reason: impl std::fmt::Display) -> Error {
    Error::StateMismatch(format!("state field {prefix}{name}: {reason}"))
}

/// `value` as a non-negative integer (never a boolean or a float).
fn count(value: Option<&Value>) -> Option<u64> {
    value.and_then(Value::as_u64)
}

/// How a value reads in an error: its JSON text, cut short.
fn shown(value: Option<&Value>) -> String {
    let text = value.map_or_else(|| "nothing".to_owned(), Value::to_string);
    match text.char_indices().nth(80) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text,
    }
}

impl MixState {
    /// Checks `value` (a JSON object) as a mixture state of a mixture of
    /// `shape`, field by field (the streams' own states are checked when
    /// they are opened), and gives it typed.
    pub fn parse(value: &Value, shape: MixShape<'_>, prefix: &str) -> Result<Self> {
        let Some(state) = value
            .as_object()
            .filter(|s| s.get("format").and_then(Value::as_str) == Some(MIX_FORMAT))
        else {
            return Err(bad(
                prefix,
                "format",
                format!("expected {MIX_FORMAT:?} (a shardstream.Mix state)"),
            ));
        };
        if state.get("version").and_then(Value::as_u64) != Some(MIX_VERSION) {
            return Err(bad(
                prefix,
                "version",
                format!("this build reads version {MIX_VERSION}"),
            ));
        }
        let names = [
            "epoch",
            "generation",
            "world_size",
            "rank",
            "num_workers",
            "worker_id",
            "position",
        ];
        for name in names {
            if count(state.get(name)).is_none() {
                return Err(bad(
                    prefix,
                    name,
                    format!(
                        "expected a non-negative int, got {}",
                        shown(state.get(name))
                    ),
                ));
            }
        }
        let field = |name: &str| count(state.get(name)).unwrap_or(0);
        if field("epoch") >= PASS_STRIDE || field("generation") >= PASS_STRIDE {
            return Err(bad(prefix, "epoch", "out of range"));
        }
        if state.get("policy").and_then(Value::as_str) != Some(shape.policy) {
            return Err(bad(
                prefix,
                "policy",
                format!(
                    "{}, this mixture's is {:?}",
                    shown(state.get("policy")),
                    shape.policy
                ),
            ));
        }
        if state.get("seed").and_then(Value::as_u64) != Some(shape.seed) {
            return Err(bad(
                prefix,
                "seed",
                format!(
                    "{}, this mixture's is {}",
                    shown(state.get("seed")),
                    shape.seed
                ),
            ));
        }
        if !state.get("finished").is_some_and(Value::is_boolean) {
            return Err(bad(prefix, "finished", "expected true or false"));
        }
        Self::check_weights(state.get("weights"), shape, prefix)?;
        Self::check_streams(state.get("streams"), shape, prefix)?;
        match state.get("resumed_from") {
            None | Some(Value::Null) => {}
            Some(Value::Array(inner)) if !inner.is_empty() => {
                for (i, each) in inner.iter().enumerate() {
                    Self::parse(each, shape, &format!("{prefix}resumed_from[{i}]."))?;
                }
            }
            Some(_) => {
                return Err(bad(
                    prefix,
                    "resumed_from",
                    "expected null or every slot's state",
                ))
            }
        }
        // The generation counts the elastic resumes within the epoch, and
        // keys the order: one edited would order the rest of the epoch
        // anew.
        let resumes = state.get("resumed_from").and_then(Value::as_array);
        let expected = resumes.map_or(0, |inner| {
            let each = |s: &Value| count(s.get("generation")).unwrap_or(0);
            inner.iter().map(each).max().unwrap_or(0) + 1
        });
        if field("generation") != expected
            || resumes.is_some_and(|inner| {
                inner
                    .iter()
                    .any(|s| count(s.get("generation")) != Some(expected - 1))
            })
        {
            return Err(bad(
                prefix,
                "generation",
                format!(
                    "{}, but the state was resumed elastically {} times in its epoch                      (one more than its resumed_from states' generation, 0 without)",
                    field("generation"),
                    expected
                ),
            ));
        }
        serde_json::from_value(value.clone()).map_err(|e| bad(prefix, "", e))
    }

    /// Checks the `weights` of a state: one number per stream, as the
    /// mixture's own weights are checked.
    fn check_weights(value: Option<&Value>, shape: MixShape<'_>, prefix: &str) -> Result<()> {
        let numbers = value.and_then(Value::as_array).and_then(|weights| {
            weights
                .iter()
                .map(|w| w.as_f64().filter(|_| !w.is_boolean()))
                .collect::<Option<Vec<f64>>>()
        });
        let Some(weights) = numbers else {
            return Err(bad(
                prefix,
                "weights",
                format!("expected a list of numbers, got {}", shown(value)),
            ));
        };
        if weights.len() != shape.streams {
            return Err(bad(
                prefix,
                "weights",
                format!("{} weights for {} streams", weights.len(), shape.streams),
            ));
        }
        check_weights(&weights).map_err(|e| bad(prefix, "weights", e))?;
        shape
            .policy
            .parse::<Policy>()
            .map(|_| ())
            .map_err(|e| bad(prefix, "policy", e))
    }

    /// Checks the `streams` of a state: one `{pass, short, state}` per
    /// stream.
    fn check_streams(value: Option<&Value>, shape: MixShape<'_>, prefix: &str) -> Result<()> {
        let Some(streams) = value
            .and_then(Value::as_array)
            .filter(|s| s.len() == shape.streams)
        else {
            return Err(bad(
                prefix,
                "streams",
                format!("expected one entry per stream ({})", shape.streams),
            ));
        };
        for (i, entry) in streams.iter().enumerate() {
            let Some(entry) = entry
                .as_object()
                .filter(|e| e.get("state").is_some_and(Value::is_object))
            else {
                return Err(bad(
                    prefix,
                    &format!("streams[{i}]"),
                    "expected {pass, short, state}",
                ));
            };
            for name in ["pass", "short"] {
                if count(entry.get(name)).is_none() {
                    return Err(bad(
                        prefix,
                        &format!("streams[{i}].{name}"),
                        format!(
                            "expected a non-negative int, got {}",
                            shown(entry.get(name))
                        ),
                    ));
                }
            }
            let pass = count(entry.get("pass")).unwrap_or(0);
            if pass >= MAX_PASSES {
                return Err(bad(
                    prefix,
                    &format!("streams[{i}].pass"),
                    format!("{pass} is not below {MAX_PASSES}"),
                ));
            }
        }
        Ok(())
    }

    /// The states of an elastic resume (every slot's, in any order, each
    /// already [`parse`](Self::parse)d) checked to be those of one job in
    /// one epoch, ordered by rank, then worker. `new_weights`: whether the
    /// resume sets weights of its own (the slots' may then differ).
    pub fn job_slots(states: Vec<MixState>, new_weights: bool) -> Result<Vec<MixState>> {
        let Some(first) = states.first() else {
            return Err(Error::StateMismatch(
                "an elastic state needs the state of every slot, got none".into(),
            ));
        };
        for (i, state) in states.iter().enumerate() {
            let same = [
                ("epoch", state.epoch == first.epoch),
                ("generation", state.generation == first.generation),
                ("world_size", state.world_size == first.world_size),
                ("num_workers", state.num_workers == first.num_workers),
                ("resumed_from", state.resumed_from == first.resumed_from),
            ];
            if let Some((name, _)) = same.iter().find(|(_, same)| !same) {
                return Err(bad(
                    &format!("slots[{i}]."),
                    name,
                    "differs from slots[0]'s: the slot states are of different epochs, \
                     layouts or resumes",
                ));
            }
            if state.weights != first.weights && !new_weights {
                return Err(bad(
                    &format!("slots[{i}]."),
                    "weights",
                    "differs from slots[0]'s",
                ));
            }
            for (s, (entry, first_entry)) in state.streams.iter().zip(&first.streams).enumerate() {
                if entry.pass != first_entry.pass {
                    return Err(bad(
                        &format!("slots[{i}]."),
                        &format!("streams[{s}].pass"),
                        "slots are in different passes over the stream; an elastic resume of \
                         policy='restart' needs every slot in the same pass (resume exactly, \
                         or save elsewhere)",
                    ));
                }
            }
        }
        let (world_size, num_workers) = (first.world_size, first.num_workers);
        let mut by_slot: std::collections::BTreeMap<(u64, u64), MixState> = Default::default();
        for (i, state) in states.into_iter().enumerate() {
            let key = (state.rank, state.worker_id);
            if key.0 >= world_size || key.1 >= num_workers {
                return Err(bad(
                    "",
                    "slots",
                    format!("slots[{i}] is of a slot outside the saved layout"),
                ));
            }
            match by_slot.get(&key) {
                Some(kept) if *kept != state => {
                    return Err(bad(
                        &format!("slots[{i}]."),
                        "rank",
                        format!(
                            "a second, different state of rank {} worker {}",
                            key.0, key.1
                        ),
                    ))
                }
                _ => {
                    by_slot.insert(key, state);
                }
            }
        }
        for rank in 0..world_size {
            for worker in 0..num_workers {
                if !by_slot.contains_key(&(rank, worker)) {
                    return Err(bad(
                        "",
                        "slots",
                        format!(
                            "elastic resume needs every one of the {world_size} x \
                             {num_workers} slots (rank {rank} worker {worker} is missing)"
                        ),
                    ));
                }
            }
        }
        Ok(by_slot.into_values().collect())
    }
}

/// The next sample of a slot's mixture: the stream it comes from, and the
/// pass over that stream to open first when the current one is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Take {
    /// The stream the sample comes from.
    pub stream: usize,
    /// The pass over the stream to open (and [`MixCursor::enter_pass`])
    /// before taking the sample, if the stream's current pass is done.
    pub opens_pass: Option<u64>,
}

/// Where a slot's mixture stands in its [`SlotPlan`]: the position in the
/// order and, per stream, the pass it is in, the samples taken from that
/// pass and, of those, the ones the stream did not give (a pass that ended
/// early: a shard skipped under `on_error="warn"`).
#[derive(Debug, Clone, PartialEq)]
pub struct MixCursor {
    plan: SlotPlan,
    position: usize,
    /// Index into `plan.passes[s]`.
    pass: Vec<usize>,
    taken: Vec<u64>,
    short: Vec<u64>,
}

impl MixCursor {
    /// A cursor at the start of `plan`.
    pub fn new(plan: SlotPlan) -> Self {
        let streams = plan.passes.len();
        MixCursor {
            plan,
            position: 0,
            pass: vec![0; streams],
            taken: vec![0; streams],
            short: vec![0; streams],
        }
    }

    /// A cursor where the slot's exact state `state` left `plan` (the plan
    /// of that state's epoch, generation and weights), each of the state's
    /// counts checked against the plan: the position, whether it finished,
    /// the pass of each stream, and each stream's samples produced (from
    /// its own state) with those it fell short against the samples the
    /// order took from it.
    pub fn resume(plan: SlotPlan, state: &MixState) -> Result<Self> {
        let len = plan.order.len();
        let position = usize::try_from(state.position)
            .ok()
            .filter(|&p| p <= len)
            .ok_or_else(|| {
                bad(
                    "",
                    "position",
                    format!("{} is past the slot's {len} samples", state.position),
                )
            })?;
        if state.finished != (position == len) {
            return Err(bad(
                "",
                "finished",
                format!(
                    "{}, but the position is {position} of the slot's {len} samples",
                    state.finished
                ),
            ));
        }
        let mut cursor = MixCursor::new(plan);
        cursor.position = position;
        let done = &cursor.plan.order[..position];
        for (s, entry) in state.streams.iter().enumerate() {
            let passes = &cursor.plan.passes[s];
            let Some(k) = entry
                .pass
                .checked_sub(cursor.plan.base[s])
                .and_then(|k| usize::try_from(k).ok())
                .filter(|&k| k < passes.len())
            else {
                return Err(bad(
                    "",
                    &format!("streams[{s}].pass"),
                    format!(
                        "{} is not a pass of the stream in this slot's plan",
                        entry.pass
                    ),
                ));
            };
            // A packed stream hands out sequences (its `produced` counts
            // documents): those of its pass's plan not left.
            let (field, produced) = match count(entry.state.get("sequences_left")) {
                Some(left) => (
                    "sequences_left",
                    cursor.plan.pass_sizes[s][k].checked_sub(left),
                ),
                None => ("produced", count(entry.state.get("produced"))),
            };
            let Some(produced) = produced else {
                return Err(bad(
                    "",
                    &format!("streams[{s}].state.{field}"),
                    "not an int, or more than the stream's pass plans",
                ));
            };
            let taken = done.iter().filter(|&&t| usize::from(t) == s).count() as u64;
            let before: u64 = passes[..k].iter().sum();
            let in_pass = produced.checked_add(entry.short);
            if in_pass.and_then(|n| n.checked_add(before)) != Some(taken) {
                return Err(bad(
                    "",
                    &format!("streams[{s}].state.{field}"),
                    format!(
                        "{} ({produced} handed out), but the mixture took {taken} samples of \
                         stream {s} before position {position}",
                        shown(entry.state.get(field))
                    ),
                ));
            }
            // The order takes a sample a stream does not give only once
            // the stream's pass has ended (early: a shard skipped).
            if entry.short > 0 && entry.state.get("finished") != Some(&Value::Bool(true)) {
                return Err(bad(
                    "",
                    &format!("streams[{s}].short"),
                    format!(
                        "{}, but the stream's own state has not ended its pass (a stream falls \
                         short only once its pass ended early)",
                        entry.short
                    ),
                ));
            }
            cursor.pass[s] = k;
            cursor.taken[s] = in_pass.unwrap_or_default();
            cursor.short[s] = entry.short;
        }
        Ok(cursor)
    }

    /// The plan the cursor walks.
    pub fn plan(&self) -> &SlotPlan {
        &self.plan
    }

    /// Samples of the order taken so far.
    pub fn position(&self) -> u64 {
        self.position as u64
    }

    /// Whether the whole order has been taken.
    pub fn finished(&self) -> bool {
        self.position >= self.plan.order.len()
    }

    /// The next sample's stream, `None` at the end of the order.
    pub fn next(&self) -> Option<Take> {
        let stream = usize::from(*self.plan.order.get(self.position)?);
        let k = self.pass[stream];
        let opens_pass = (self.taken[stream] >= self.plan.passes[stream][k])
            .then(|| self.plan.base[stream] + k as u64 + 1);
        Some(Take { stream, opens_pass })
    }

    /// Moves stream `s` on to its next pass (once that pass is open).
    pub fn enter_pass(&mut self, s: usize) {
        self.pass[s] += 1;
        self.taken[s] = 0;
        self.short[s] = 0;
    }

    /// Counts the sample taken from stream `s`; `given`: whether the stream
    /// gave it (not: its pass ended early).
    pub fn took(&mut self, s: usize, given: bool) {
        self.taken[s] += 1;
        self.short[s] += u64::from(!given);
        self.position += 1;
    }

    /// The pass over stream `s` the slot is in, and the samples of it the
    /// stream did not give.
    pub fn entry(&self, s: usize) -> (u64, u64) {
        (self.plan.base[s] + self.pass[s] as u64, self.short[s])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::mix::SlotMixture;
    use serde_json::json;

    const SHAPE: MixShape<'static> = MixShape {
        policy: "stop",
        seed: 7,
        streams: 2,
    };

    fn state(rank: u64, worker: u64) -> Value {
        json!({
            "format": MIX_FORMAT, "version": MIX_VERSION, "epoch": 3, "generation": 0,
            "policy": "stop", "seed": 7, "weights": [0.25, 0.75],
            "world_size": 2, "rank": rank, "num_workers": 2, "worker_id": worker,
            "position": 5, "finished": false,
            "streams": [
                {"pass": 0, "short": 0, "state": {"produced": 2}},
                {"pass": 0, "short": 0, "state": {"produced": 3}}
            ],
            "resumed_from": null
        })
    }

    fn refused(result: Result<impl std::fmt::Debug>) -> String {
        match result {
            Err(Error::StateMismatch(message)) => message,
            other => panic!("expected a state mismatch, got {other:?}"),
        }
    }

    #[test]
    fn a_state_reads_back_typed_and_serialises_to_the_same_json() {
        let parsed = MixState::parse(&state(1, 0), SHAPE, "").unwrap();
        assert_eq!((parsed.rank, parsed.position), (1, 5));
        assert_eq!(serde_json::to_value(&parsed).unwrap(), state(1, 0));
    }

    #[test]
    fn each_damaged_field_is_named() {
        let cases = [
            ("format", json!("shardstream.state")),
            ("version", json!(2)),
            ("epoch", json!(-1)),
            ("epoch", json!(PASS_STRIDE)),
            ("generation", json!("1")),
            // Not resumed elastically: an edited generation would order
            // the rest of the epoch anew.
            ("generation", json!(2)),
            ("position", json!(null)),
            ("rank", json!(true)),
            ("policy", json!("restart")),
            ("seed", json!(8)),
            ("finished", json!(1)),
            ("weights", json!([1.0])),
            ("weights", json!([-1.0, 2.0])),
            ("weights", json!([true, 1.0])),
            ("streams", json!([])),
            ("streams[0]", json!([{"pass": 0}, {"pass": 0}])),
            ("resumed_from", json!([])),
            ("resumed_from[0].format", json!([{"format": "x"}])),
        ];
        for (field, value) in cases {
            let mut damaged = state(0, 0);
            let key = field.split(['[', '.']).next().unwrap();
            damaged[key] = value;
            let message = refused(MixState::parse(&damaged, SHAPE, "slots[1]."));
            assert!(
                message.starts_with(&format!("state field slots[1].{field}")),
                "{field}: {message}"
            );
        }
        let mut many = state(0, 0);
        many["streams"][1]["pass"] = json!(MAX_PASSES);
        let message = refused(MixState::parse(&many, SHAPE, ""));
        assert!(
            message.starts_with("state field streams[1].pass"),
            "{message}"
        );
        // Resumed elastically once: generation 1, its states' 0.
        let mut resumed = state(0, 0);
        resumed["resumed_from"] = json!([state(0, 0), state(1, 0)]);
        resumed["generation"] = json!(1);
        MixState::parse(&resumed, SHAPE, "").unwrap();
        for (outer, inner) in [(0, 0), (2, 0), (2, 1)] {
            resumed["generation"] = json!(outer);
            resumed["resumed_from"][1]["generation"] = json!(inner);
            let message = refused(MixState::parse(&resumed, SHAPE, ""));
            assert!(message.contains("generation"), "{outer} {inner}: {message}");
        }
    }

    fn slots(keys: &[(u64, u64)]) -> Vec<MixState> {
        keys.iter()
            .map(|&(r, w)| MixState::parse(&state(r, w), SHAPE, "").unwrap())
            .collect()
    }

    #[test]
    fn a_job_s_slots_come_back_by_rank_then_worker() {
        let ordered = MixState::job_slots(slots(&[(1, 1), (0, 1), (1, 0), (0, 0)]), false).unwrap();
        let keys: Vec<_> = ordered.iter().map(|s| (s.rank, s.worker_id)).collect();
        assert_eq!(keys, [(0, 0), (0, 1), (1, 0), (1, 1)]);
    }

    #[test]
    fn slots_of_another_job_missing_or_repeated_slots_are_refused() {
        let missing = refused(MixState::job_slots(slots(&[(0, 0), (0, 1), (1, 1)]), false));
        assert!(
            missing.contains("every one of the 2 x 2 slots (rank 1 worker 0"),
            "{missing}"
        );
        let mut other = slots(&[(0, 0), (0, 1), (1, 0), (1, 1)]);
        other[2].epoch = 4;
        let epoch = refused(MixState::job_slots(other, false));
        assert!(epoch.starts_with("state field slots[2].epoch"), "{epoch}");
        let mut twice = slots(&[(0, 0), (0, 1), (1, 0), (1, 1), (1, 1)]);
        twice[4].position = 6;
        let repeated = refused(MixState::job_slots(twice.clone(), false));
        assert!(
            repeated.contains("a second, different state of rank 1 worker 1"),
            "{repeated}"
        );
        twice[4].position = 5;
        assert_eq!(MixState::job_slots(twice, false).unwrap().len(), 4);
        let mut weights = slots(&[(0, 0), (0, 1), (1, 0), (1, 1)]);
        weights[1].weights = vec![0.5, 0.5];
        assert!(MixState::job_slots(weights.clone(), false).is_err());
        assert!(MixState::job_slots(weights, true).is_ok());
        let mut outside = slots(&[(0, 0), (0, 1), (1, 0), (1, 1)]);
        outside[3].worker_id = 2;
        assert!(refused(MixState::job_slots(outside, false)).contains("outside the saved layout"));
    }

    /// Takes one sample with `cursor`, a stream falling short where
    /// `short(s, pass, k)` (its `k`-th sample of pass `pass`): the stream
    /// and the pass opened first, if one was; `None` at the end.
    fn step(
        cursor: &mut MixCursor,
        short: &impl Fn(usize, u64, u64) -> bool,
    ) -> Option<(usize, Option<u64>)> {
        let take = cursor.next()?;
        if take.opens_pass.is_some() {
            cursor.enter_pass(take.stream);
        }
        let (pass, _) = cursor.entry(take.stream);
        let k = cursor.taken[take.stream];
        cursor.took(take.stream, !short(take.stream, pass, k));
        Some((take.stream, take.opens_pass))
    }

    /// Walks `cursor` to the end: the stream of each sample taken and the
    /// passes opened.
    fn walk(
        cursor: &mut MixCursor,
        short: impl Fn(usize, u64, u64) -> bool,
    ) -> (Vec<usize>, Vec<(usize, u64)>) {
        let (mut taken, mut opened) = (vec![], vec![]);
        while let Some((stream, pass)) = step(cursor, &short) {
            opened.extend(pass.map(|p| (stream, p)));
            taken.push(stream);
        }
        (taken, opened)
    }

    /// Takes `n` samples with `cursor`.
    fn advance(cursor: &mut MixCursor, n: usize, short: impl Fn(usize, u64, u64) -> bool) {
        for _ in 0..n {
            step(cursor, &short).unwrap();
        }
    }

    fn restart_plan() -> SlotPlan {
        let mixture = SlotMixture {
            policy: Policy::Restart,
            weights: &[3.0, 1.0],
            key: (7, 3),
            slot: 1,
            generation: 0,
        };
        // Stream 0 gives 4 samples a pass; stream 1 gives 3, then 2 later.
        SlotPlan::new(mixture, vec![0, 0], &[4, 3], |s, pass| {
            assert_eq!(s, 0, "only the stream that runs out is read again");
            Ok(if pass < 2 { 4 } else { 2 })
        })
        .unwrap()
    }

    #[test]
    fn a_restart_plan_reads_passes_until_the_count_is_met_and_cuts_the_last() {
        let plan = restart_plan();
        assert_eq!(plan.counts, vec![9, 3]);
        assert_eq!(plan.passes, vec![vec![4, 4, 1], vec![3]]);
        assert_eq!(plan.order.len(), 12);
        let mut cursor = MixCursor::new(plan);
        let (taken, opened) = walk(&mut cursor, |_, _, _| false);
        assert_eq!(taken.iter().filter(|&&s| s == 0).count(), 9);
        assert_eq!(opened, vec![(0, 1), (0, 2)]);
        assert!(cursor.finished());
    }

    #[test]
    fn too_many_passes_and_empty_restarts_are_errors() {
        let mixture = SlotMixture {
            policy: Policy::Restart,
            weights: &[1e6, 1.0],
            key: (1, 0),
            slot: 0,
            generation: 0,
        };
        let error = SlotPlan::new(mixture, vec![0, 0], &[1, 100], |_, _| Ok(1)).unwrap_err();
        assert!(
            error.to_string().contains("more than 1024 times"),
            "{error}"
        );
        // A pass of none: the stream cannot come in its weight (before, it
        // ended there, and the other stream took its place).
        let error = SlotPlan::new(mixture, vec![0, 0], &[1, 100], |_, _| Ok(0)).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("stream 0 has no sample for slot 0"),
            "{error}"
        );
        let error = SlotPlan::new(mixture, vec![0, 0], &[0, 100], |_, _| Ok(0)).unwrap_err();
        assert!(error.to_string().contains("policy='continue'"), "{error}");
    }

    /// The state a cursor stands at, its streams' `produced` counted as
    /// the samples each stream gave in its pass.
    fn state_at(cursor: &MixCursor) -> MixState {
        let mut value = state(0, 0);
        value["position"] = json!(cursor.position());
        value["finished"] = json!(cursor.finished());
        value["policy"] = json!("restart");
        let streams = (0..2)
            .map(|s| {
                let (pass, short) = cursor.entry(s);
                json!({"pass": pass, "short": short,
                       "state": {"produced": cursor.taken[s] - short, "finished": short > 0}})
            })
            .collect::<Vec<_>>();
        value["streams"] = json!(streams);
        let shape = MixShape {
            policy: "restart",
            ..SHAPE
        };
        MixState::parse(&value, shape, "").unwrap()
    }

    #[test]
    fn a_packed_stream_s_sequences_left_count_down_from_its_whole_pass() {
        // Stream 0's last pass is cut to 1 of the 2 samples it gives: a
        // packed stream's `sequences_left` counts down from the 2.
        let plan = restart_plan();
        assert_eq!(
            (plan.passes[0].clone(), plan.pass_sizes[0].clone()),
            (vec![4, 4, 1], vec![4, 4, 2])
        );
        let total = plan.order.len();
        for at in 0..=total {
            let mut cursor = MixCursor::new(plan.clone());
            advance(&mut cursor, at, |_, _, _| false);
            let mut state = state_at(&cursor);
            for (s, stream) in state.streams.iter_mut().enumerate() {
                let size = plan.pass_sizes[s][cursor.pass[s]];
                let left = size - cursor.taken[s];
                stream.state.insert("sequences_left".into(), json!(left));
                stream.state.insert("produced".into(), json!(999));
            }
            let resumed = MixCursor::resume(plan.clone(), &state);
            assert_eq!(resumed.as_ref().ok(), Some(&cursor), "at {at}: {resumed:?}");
        }
    }

    proptest::proptest! {
        /// Whatever the mixture, a cursor takes each stream's count, and
        /// one resumed from the state at any position is the one that got
        /// there and takes the same rest.
        #[test]
        fn a_resumed_cursor_is_the_one_that_got_there(
            weights in proptest::collection::vec(0.0f64..4.0, 2),
            first in proptest::collection::vec(0u64..20, 2),
            restarts in proptest::collection::vec(0u64..12, 8),
            policy in 0usize..3,
            salt in 0u64..7,
            at in 0.0f64..=1.0,
        ) {
            proptest::prop_assume!(weights.iter().any(|&w| w > 0.0));
            let policy = [Policy::Stop, Policy::Restart, Policy::Continue][policy];
            let mixture = SlotMixture { policy, weights: &weights, key: (5, 2), slot: 3, generation: 1 };
            let plan = SlotPlan::new(mixture, vec![0, 0], &first, |s, pass| {
                Ok(restarts[(s * 4 + pass as usize) % restarts.len()])
            });
            // A mixture refused at construction (a stream that would be
            // read past the restart bound) has no cursor to resume.
            proptest::prop_assume!(plan.is_ok());
            let plan = plan.unwrap();
            let short = |s: usize, pass: u64, k: u64| (s as u64 * 13 + pass * 7 + k + salt).is_multiple_of(7);
            let mut whole = MixCursor::new(plan.clone());
            let (all, _) = walk(&mut whole, short);
            for (s, &count) in plan.counts.iter().enumerate() {
                proptest::prop_assert_eq!(all.iter().filter(|&&t| t == s).count() as u64, count);
            }
            let at = (at * all.len() as f64) as usize;
            let mut cursor = MixCursor::new(plan.clone());
            advance(&mut cursor, at, short);
            let mut resumed = MixCursor::resume(plan, &state_at(&cursor)).unwrap();
            proptest::prop_assert_eq!(&resumed, &cursor);
            proptest::prop_assert_eq!(walk(&mut resumed, short).0, all[at..].to_vec());
        }
    }

    #[test]
    fn a_cursor_resumed_from_any_position_takes_the_same_rest() {
        let plan = restart_plan();
        let short = |s: usize, pass: u64, k: u64| s == 1 && pass == 0 && k == 2;
        let mut whole = MixCursor::new(plan.clone());
        let (all, _) = walk(&mut whole, short);
        for at in 0..=all.len() {
            let mut cursor = MixCursor::new(plan.clone());
            advance(&mut cursor, at, short);
            let mut resumed = MixCursor::resume(plan.clone(), &state_at(&cursor)).unwrap();
            assert_eq!(resumed, cursor, "resumed at {at}");
            let (rest, _) = walk(&mut resumed, short);
            assert_eq!(rest, all[at..].to_vec(), "resumed at {at}");
        }
    }

    #[test]
    fn a_resumed_state_that_does_not_fit_the_plan_is_refused_by_field() {
        let plan = restart_plan();
        let mut cursor = MixCursor::new(plan.clone());
        advance(&mut cursor, 5, |_, _, _| false);
        let good = state_at(&cursor);
        let damaged = |change: &dyn Fn(&mut MixState)| {
            let mut state = good.clone();
            change(&mut state);
            refused(MixCursor::resume(plan.clone(), &state))
        };
        assert!(damaged(&|s| s.position = 13).contains("field position: 13 is past"));
        assert!(damaged(&|s| s.finished = true).contains("field finished"));
        assert!(damaged(&|s| s.streams[1].pass = 1).contains("streams[1].pass"));
        // One sample more taken, counted short by a stream not at its end.
        let next = usize::from(plan.order[5]);
        assert!(damaged(&|s| {
            s.position += 1;
            s.streams[next].short = 1;
        })
        .contains(&format!(
            "streams[{next}].short: 1, but the stream's own state has not ended its pass"
        )));
        assert!(damaged(&|s| {
            s.streams[0].state.insert("produced".into(), json!(99));
        })
        .contains("streams[0].state.produced: 99 (99 handed out), but the mixture took"));
        // A packed stream's sequences handed out: its pass's plan less
        // those left.
        let planned = plan.passes[0][0];
        assert!(damaged(&|s| {
            s.streams[0]
                .state
                .insert("sequences_left".into(), json!(planned));
        })
        .contains(&format!(
            "streams[0].state.sequences_left: {planned} (0 handed out), but the mixture took"
        )));
        assert!(damaged(&|s| {
            s.streams[0]
                .state
                .insert("sequences_left".into(), json!(planned + 1));
        })
        .contains("streams[0].state.sequences_left: not an int, or more than"));
        assert!(damaged(&|s| {
            s.streams[0].state.remove("produced");
        })
        .contains("streams[0].state.produced: not an int"));
    }
}
