//! The sample ledger: what each rank's optimizer steps consumed, written
//! by `shardstream.Ledger` during training ([`file`](mod@file): the format, read
//! back), and its verifier ([`verify`]: each epoch's coverage proved
//! against the replayed plan, or the first violation named; [`verify_mix`]:
//! the same for a `Mix`; [`verify_pack`]: what packing across ranks
//! leaves out, each slot's order and packer replayed), and which samples a
//! step sees ([`explain`], from the plan alone; [`explain_pack`]: which
//! pieces of documents each sequence of a packed step holds).

pub mod explain;
pub mod explain_pack;
pub mod file;
pub mod verify;
pub mod verify_mix;
pub mod verify_pack;
