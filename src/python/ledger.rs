//! The ledger's record encoder for `shardstream.Ledger`: the records a
//! flush writes, encoded in one call ([`crate::ledger::file::encode_records`]),
//! so that recording a step costs Python no work per sample.

use numpy::{PyReadonlyArray1, PyReadonlyArray2};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::ledger::file::{encode_records, MixedEpochs, RecordHead, RecordKind};

/// The bytes of records `(steps[r], epochs[r], kinds[r])` (an epoch of
/// `None`: the record's first sample's), record `r` holding the next
/// `counts[r]` samples of `ids` (their epoch, shard index and index in the
/// shard, `int64`): a `(N, 3)` array, or its three columns. As the ledger
/// file holds them (docs/ledger.md). `ValueError` for a step whose samples
/// are of several epochs, or ids that do not match the counts.
#[pyfunction]
pub fn encode_ledger_records<'py>(
    py: Python<'py>,
    steps: Vec<u64>,
    epochs: Vec<Option<u64>>,
    kinds: Vec<u32>,
    counts: Vec<usize>,
    ids: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
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
        let kind = [
            RecordKind::Trained,
            RecordKind::Skipped,
            RecordKind::EpochEnd,
        ]
        .into_iter()
        .find(|k| k.code() == code)
        .ok_or_else(|| PyValueError::new_err(format!("record kind {code} is not 0, 1 or 2")))?;
        heads.push(RecordHead {
            step: steps[r],
            epoch: epochs[r],
            kind,
            count: counts[r],
        });
    }
    let total: usize = counts.iter().sum();
    // The ids are never negative: int64 is read as u64 (a negative one
    // would be written wide, and found by verify as outside the dataset).
    let encoded = if let Ok(rows) = ids.extract::<PyReadonlyArray2<'py, i64>>() {
        let view = rows.as_array();
        if view.dim() != (total, 3) {
            return Err(wrong_ids(format!("{:?}", view.dim()), total));
        }
        match rows.as_slice() {
            Ok(flat) => encode_records(&heads, |i| {
                let row = &flat[3 * i..3 * i + 3];
                (row[0] as u64, row[1] as u64, row[2] as u64)
            }),
            Err(_) => encode_records(&heads, |i| {
                (
                    view[[i, 0]] as u64,
                    view[[i, 1]] as u64,
                    view[[i, 2]] as u64,
                )
            }),
        }
    } else {
        let columns: [PyReadonlyArray1<'py, i64>; 3] = ids.extract()?;
        let [a, b, c] = columns.each_ref().map(|column| column.as_array());
        if [a.len(), b.len(), c.len()] != [total; 3] {
            let lengths = format!("{}, {} and {}", a.len(), b.len(), c.len());
            return Err(wrong_ids(lengths, total));
        }
        match (a.as_slice(), b.as_slice(), c.as_slice()) {
            (Some(a), Some(b), Some(c)) => {
                encode_records(&heads, |i| (a[i] as u64, b[i] as u64, c[i] as u64))
            }
            _ => encode_records(&heads, |i| (a[i] as u64, b[i] as u64, c[i] as u64)),
        }
    };
    let bytes = encoded.map_err(|mixed: MixedEpochs| PyValueError::new_err(mixed.to_string()))?;
    Ok(PyBytes::new(py, &bytes))
}

fn wrong_ids(shape: String, total: usize) -> PyErr {
    PyValueError::new_err(format!(
        "__id__ rows of shape {shape} for records of {total} samples"
    ))
}
