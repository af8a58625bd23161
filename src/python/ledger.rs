//! The ledger's record buffer for `shardstream.Ledger`: records encoded in
//! Rust as they come ([`crate::ledger::file::encode_records`]), a Rust
//! batch's ids while the batch is fresh, and kept until a flush writes them,
//! so that recording a step costs Python no work per sample.

use numpy::{PyReadonlyArray1, PyReadonlyArray2};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::ledger::file::{encode_records, MixedEpochs, RecordHead, RecordKind};

/// Ledger records, encoded as the ledger file holds them (docs/ledger.md),
/// kept until taken.
#[pyclass(module = "shardstream._core")]
pub struct LedgerRecords {
    bytes: Vec<u8>,
    samples: usize,
}

#[pymethods]
impl LedgerRecords {
    /// An empty buffer.
    #[new]
    fn new() -> Self {
        LedgerRecords {
            bytes: Vec::new(),
            samples: 0,
        }
    }

    /// Samples in the records held.
    #[getter]
    fn samples(&self) -> usize {
        self.samples
    }

    /// Appends the record of `step` (`kind`: 0 trained, 1 skipped) holding
    /// a Rust batch's `(B, 3)` `int64` ids (epoch, shard index, index in
    /// the shard), at least one. `ValueError` when its samples are of
    /// several epochs, or the ids are not of that form.
    fn push_batch(&mut self, step: u64, kind: u32, ids: PyReadonlyArray2<'_, i64>) -> PyResult<()> {
        let rows = ids.as_array();
        let (count, width) = rows.dim();
        if width != 3 || count == 0 {
            return Err(PyValueError::new_err(format!(
                "__id__ is not (epoch, shard, index) per sample: got an array of shape \
                 ({count}, {width})"
            )));
        }
        let head = [RecordHead {
            step,
            epoch: None,
            kind: record_kind(kind)?,
            count,
        }];
        encode_rows(&head, &ids, &mut self.bytes).map_err(mixed_epochs)?;
        self.samples += count;
        Ok(())
    }

    /// Appends records `(steps[r], epochs[r], kinds[r])` (an epoch of
    /// `None`: the record's first sample's), record `r` holding the next
    /// `counts[r]` samples of `ids` (`int64`): a `(N, 3)` array, or its
    /// three columns. `ValueError` for a step whose samples are of several
    /// epochs, or ids that do not match the counts; nothing is appended
    /// then.
    fn push(
        &mut self,
        steps: Vec<u64>,
        epochs: Vec<Option<u64>>,
        kinds: Vec<u32>,
        counts: Vec<usize>,
        ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let records = steps.len();
        if epochs.len() != records || kinds.len() != records || counts.len() != records {
            return Err(PyValueError::new_err(format!(
                "{records} steps, {} epochs, {} kinds and {} counts: one of each per record",
                epochs.len(),
                kinds.len(),
                counts.len()
            )));
        }
        let mut heads = Vec::with_capacity(records);
        for (r, &code) in kinds.iter().enumerate() {
            heads.push(RecordHead {
                step: steps[r],
                epoch: epochs[r],
                kind: record_kind(code)?,
                count: counts[r],
            });
        }
        let total: usize = counts.iter().sum();
        let out = &mut self.bytes;
        let encoded = if let Ok(rows) = ids.extract::<PyReadonlyArray2<'_, i64>>() {
            let view = rows.as_array();
            if view.dim() != (total, 3) {
                return Err(wrong_ids(format!("{:?}", view.dim()), total));
            }
            encode_rows(&heads, &rows, out)
        } else {
            let columns: [PyReadonlyArray1<'_, i64>; 3] = ids.extract()?;
            let [a, b, c] = columns.each_ref().map(|column| column.as_array());
            if [a.len(), b.len(), c.len()] != [total; 3] {
                let lengths = format!("{}, {} and {}", a.len(), b.len(), c.len());
                return Err(wrong_ids(lengths, total));
            }
            match (a.as_slice(), b.as_slice(), c.as_slice()) {
                (Some(a), Some(b), Some(c)) => {
                    encode_records(&heads, |i| (a[i] as u64, b[i] as u64, c[i] as u64), out)
                }
                _ => encode_records(&heads, |i| (a[i] as u64, b[i] as u64, c[i] as u64), out),
            }
        };
        encoded.map_err(mixed_epochs)?;
        self.samples += total;
        Ok(())
    }

    /// The records held, as bytes; the buffer is then empty.
    fn take<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let bytes = PyBytes::new(py, &self.bytes);
        self.bytes.clear();
        self.samples = 0;
        bytes
    }
}

/// Appends `heads`' records, their ids the rows of `rows` (`(N, 3)`,
/// checked by the caller). The ids are never negative: a negative one (not
/// a sample's) would be written wide, and found by verify outside the
/// dataset.
fn encode_rows(
    heads: &[RecordHead],
    rows: &PyReadonlyArray2<'_, i64>,
    out: &mut Vec<u8>,
) -> Result<(), MixedEpochs> {
    match rows.as_slice() {
        Ok(flat) => encode_records(
            heads,
            |i| {
                (
                    flat[3 * i] as u64,
                    flat[3 * i + 1] as u64,
                    flat[3 * i + 2] as u64,
                )
            },
            out,
        ),
        Err(_) => {
            let view = rows.as_array();
            encode_records(
                heads,
                |i| {
                    (
                        view[[i, 0]] as u64,
                        view[[i, 1]] as u64,
                        view[[i, 2]] as u64,
                    )
                },
                out,
            )
        }
    }
}

fn record_kind(code: u32) -> PyResult<RecordKind> {
    [
        RecordKind::Trained,
        RecordKind::Skipped,
        RecordKind::EpochEnd,
    ]
    .into_iter()
    .find(|k| k.code() == code)
    .ok_or_else(|| PyValueError::new_err(format!("record kind {code} is not 0, 1 or 2")))
}

fn mixed_epochs(mixed: MixedEpochs) -> PyErr {
    PyValueError::new_err(mixed.to_string())
}

fn wrong_ids(shape: String, total: usize) -> PyErr {
    PyValueError::new_err(format!(
        "__id__ rows of shape {shape} for records of {total} samples"
    ))
}
