//! Parquet: footers and row groups decoded into Arrow batches and rows.
//!
//! Like every format, this module does no I/O: the caller fetches bytes and
//! hands them over. Reading a file goes:
//!
//! 1. fetch the last [`FOOTER_PROBE`] bytes (or the whole file, if smaller)
//!    and call [`decode_footer`]; on [`FooterDecode::NeedTail`] fetch that
//!    many tail bytes and call it again;
//! 2. for each row group (the unit of work), fetch the bytes of
//!    [`row_group_span`] and decode them with [`read_row_group`] into Arrow
//!    batches;
//! 3. for per-row output, turn each batch into [`Sample`](crate::format::Sample)s with
//!    [`batch_to_samples`], whose values match pyarrow's `to_pylist()`.
//!
//! Every failure is an [`Error::Format`](crate::error::Error::Format) naming the file's URL and a byte
//! offset; a panic inside the Parquet decoder on corrupt bytes is caught and
//! reported the same way.

mod footer;
mod row_group;
mod rows;
#[cfg(test)]
mod tests;

pub use footer::{decode_footer, row_group_rows, row_group_span, FooterDecode, FOOTER_PROBE};
pub use row_group::{read_row_group, RowGroupBatches};
pub use rows::{batch_to_samples, columns_with_key};
