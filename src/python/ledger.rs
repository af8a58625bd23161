//! The ledger's record buffer for `shardstream.Ledger`: records encoded in
//! Rust as they come ([`crate::ledger::file::encode_records`]), a Rust
//! batch's ids while the batch is fresh, and kept until a flush writes them,
//! so that recording a step costs Python no work per sample.

use numpy::{PyReadonlyArray1, PyReadonlyArray2};
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::ledger::file::{encode_records, MixedEpochs, RecordHead, RecordKind};

/// Ledger records, encoded as the ledger file holds them (docs/ledger.md),
/// kept until taken.
#[pyclass(module = "shardstream._core")]
pub struct LedgerRecords {
    bytes: Vec<u8>,
    samples: usize,
    /// `torch.Tensor` and `torch.int64`, once a step's tensors have been
    /// pushed.
    torch: Option<[Py<PyAny>; 2]>,
}

#[pymethods]
impl LedgerRecords {
    /// An empty buffer.
    #[new]
    fn new() -> Self {
        LedgerRecords {
            bytes: Vec::new(),
            samples: 0,
            torch: None,
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

    /// Appends the record of `step` (`kind`: 0 trained, 1 skipped) holding
    /// the ids of a DataLoader batch (`default_collate`'s three columns:
    /// epoch, shard index, index in the shard), encoded now, while the
    /// batch is fresh. Returns the samples the records held now hold; 0,
    /// appending nothing, when the columns are not three `torch.Tensor`s
    /// of `int64`, on the CPU, contiguous, of one non-zero length (the
    /// caller reads them another way). `ValueError` when the step's
    /// samples are of several epochs.
    fn push_tensors(
        &mut self,
        py: Python<'_>,
        step: u64,
        kind: u32,
        epoch: &Bound<'_, PyAny>,
        shard: &Bound<'_, PyAny>,
        index: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let kind = record_kind(kind)?;
        if self.torch.is_none() {
            let torch = py.import("torch")?;
            let name = |name: &str| torch.getattr(name).map(Bound::unbind);
            self.torch = Some([name("Tensor")?, name("int64")?]);
        }
        let [tensor, int64] = self.torch.as_ref().expect("set above");
        let (tensor, int64) = (tensor.bind(py), int64.bind(py));
        let mut views: [&[i64]; 3] = [&[]; 3];
        for (view, column) in views.iter_mut().zip([epoch, shard, index]) {
            // A sparse or other unstrided tensor raises in `is_contiguous`
            // or `data_ptr`: not a plain column either.
            match plain_int64_column(column, tensor, int64) {
                // SAFETY: the column is a `torch.Tensor` (not a subclass)
                // of `int64` on the CPU and contiguous: its `numel()`
                // elements lie at `data_ptr()` (checked aligned and
                // non-null), in memory its storage owns. The tensor is
                // alive (the caller's) and the GIL is held while the slice
                // lives, so no Python code can resize or free it meanwhile
                // (as for `Tensor.numpy()`, a torch op on this very tensor
                // already running without the GIL in another thread is the
                // caller's not to start while it records the batch).
                Ok(Some((address, len))) => {
                    *view = unsafe { std::slice::from_raw_parts(address as *const i64, len) };
                }
                Ok(None) | Err(_) => return Ok(0),
            }
        }
        let [a, b, c] = views;
        let count = a.len();
        if b.len() != count || c.len() != count {
            return Ok(0);
        }
        let head = [RecordHead {
            step,
            epoch: None,
            kind,
            count,
        }];
        encode_records(
            &head,
            |i| (a[i] as u64, b[i] as u64, c[i] as u64),
            &mut self.bytes,
        )
        .map_err(mixed_epochs)?;
        self.samples += count;
        Ok(self.samples)
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

/// The address and length of `column`'s elements when it is a
/// `torch.Tensor` (not a subclass) of `int64`, on the CPU, contiguous, of
/// at least one element, at an aligned non-null address.
fn plain_int64_column(
    column: &Bound<'_, PyAny>,
    tensor: &Bound<'_, PyAny>,
    int64: &Bound<'_, PyAny>,
) -> PyResult<Option<(usize, usize)>> {
    let py = column.py();
    let plain = column.get_type().is(tensor)
        && column.getattr(intern!(py, "dtype"))?.is(int64)
        && column.getattr(intern!(py, "is_cpu"))?.is_truthy()?
        && column
            .call_method0(intern!(py, "is_contiguous"))?
            .is_truthy()?;
    if !plain {
        return Ok(None);
    }
    let len: usize = column.call_method0(intern!(py, "numel"))?.extract()?;
    let address: usize = column.call_method0(intern!(py, "data_ptr"))?.extract()?;
    let usable = len > 0 && address != 0 && address.is_multiple_of(align_of::<i64>());
    Ok(usable.then_some((address, len)))
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
