//! Stream state for exact and elastic resume. The consumer keeps a mirror
//! of the pipeline's position (cursor, shuffle buffer ids, RNG word
//! position, and a checksum of what was handed out) as of the last sample
//! it handed out; restoring re-reads only the samples the buffer held. The
//! JSON form is documented by `schemas/state.schema.json`.
//!
//! A loaded state is never trusted: [`resolve`] checks every field against
//! the dataset and the plan before anything is read, so a damaged, edited or
//! mismatched state is an [`Error::StateMismatch`](crate::Error::StateMismatch) naming the field, never a
//! panic, a repeated sample or a silently shorter epoch.

pub mod mix;

mod check;
mod digest;
mod mirror;
mod saved;

pub(crate) use check::TOKENS_PART;
pub use check::{fingerprint, resolve, Fingerprint, Resume, Start};
pub use digest::runs_digest;
pub use mirror::{Mirror, Op, SkippedSamples};
pub(crate) use saved::format_digest;
pub use saved::{Cursor, SlotState, STATE_FORMAT, STATE_VERSION};
