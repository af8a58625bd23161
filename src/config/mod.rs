//! Stream options, with defaults and validation in one place, and the one
//! definition of every dataset option ([`DATASET_OPTIONS`]): the options of
//! a stream (`stream.rs`), their value types (`values.rs`), how stores are
//! reached (`store.rs`), the table of options (`table.rs`) and the builder
//! that checks them (`builder.rs`).

mod builder;
mod store;
mod stream;
mod table;
mod values;

pub use builder::StreamOptionsBuilder;
pub use store::{StoreOptions, Transport};
pub use stream::{
    CacheOptions, StreamOptions, MAX_BUDGET_BYTES, MAX_ITEMS, READ_AHEAD_BYTES,
    READ_AHEAD_BYTES_ALONE,
};
pub use table::{DefaultValue, OptionDef, OrderBytes, SampleOrder, DATASET_OPTIONS, S3_OPTIONS};
pub use values::{FieldDecoders, HttpHeaders, OnError, TableOutput};
