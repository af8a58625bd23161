//! Packing tokenized documents into fixed-length sequences (the `pack`
//! option, `shardstream.Pack`): [`Packer`] takes each document's token ids
//! in stream order and hands out sequences of `seq_len + 1` token slots,
//! either end to end ([`PackMode::Concat`]: documents split across
//! sequences) or each document whole in the open sequence it fills best
//! ([`PackMode::BestFit`]: the rest padded).
//!
//! Pure: no I/O. What it holds (sequences filled and not handed out, and
//! the open ones) is described by [`PackState`] as pieces of documents
//! (shard, index, first token, end token), small whatever the documents'
//! length: a resumed stream reads those documents again, tokenizes them
//! again (deterministically) and [`Packer::restore`]s the same sequences.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::{Sample, SampleId, SAMPLE_ID_FIELD, SEQUENCE_EPOCH_FIELD};
use crate::value::{Array, ArrayData, Value};

/// The most tokens a packed sequence may hold.
pub const MAX_SEQ_LEN: usize = 1 << 24;

/// The most open sequences `"best_fit"` may keep.
pub const MAX_WINDOW: usize = 4096;

/// The open sequences `"best_fit"` keeps when `window` is not given.
pub const DEFAULT_WINDOW: usize = 64;

/// The label of a position whose next token is padding (PyTorch's
/// `cross_entropy` ignores it by default).
pub const IGNORE_LABEL: i32 = -100;

/// How documents are laid into sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackMode {
    /// Documents end to end, a document split where a sequence ends: no
    /// padding but in the epoch's last sequence.
    Concat,
    /// Each document (or each `seq_len + 1`-token piece of a longer one)
    /// whole in the open sequence whose room it fills best, among at most
    /// `window` open ones; when none has room and `window` are open, the
    /// fullest is handed out padded.
    BestFit {
        /// Open sequences kept at most.
        window: usize,
    },
}

/// What `pack` does: which field holds the token ids, the sequence length,
/// the mode, whether labels come apart, and the padding id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackSpec {
    /// The field with each document's token ids (a 1-D integer array, or a
    /// list of ints), e.g. a `Tokenizer`'s; `None`: the one field `decode`
    /// tokenizes (the options resolve it when they are built).
    pub field: Option<String>,
    /// Tokens a step trains on: each sequence takes `seq_len + 1` tokens
    /// (the inputs and, shifted by one, the labels).
    pub seq_len: usize,
    /// How documents are laid into sequences.
    pub mode: PackMode,
    /// Hand out `input_ids` of `seq_len` and `labels` of `seq_len` (the next
    /// token of each position, [`IGNORE_LABEL`] before padding); otherwise
    /// `input_ids` of `seq_len + 1`.
    pub labels: bool,
    /// The id that fills the unused end of a sequence.
    pub pad_id: i32,
}

impl PackSpec {
    /// Checks the parameters: the error names the one that is wrong.
    pub fn new(
        field: Option<String>,
        seq_len: usize,
        mode: PackMode,
        labels: bool,
        pad_id: i32,
    ) -> std::result::Result<Self, (&'static str, String)> {
        if field.as_deref() == Some("") {
            return Err(("field", "the field name is empty".into()));
        }
        if !(1..=MAX_SEQ_LEN).contains(&seq_len) {
            return Err(("seq_len", format!("{seq_len} is not in 1..={MAX_SEQ_LEN}")));
        }
        if let PackMode::BestFit { window } = mode {
            if !(1..=MAX_WINDOW).contains(&window) {
                return Err(("window", format!("{window} is not in 1..={MAX_WINDOW}")));
            }
        }
        Ok(PackSpec {
            field,
            seq_len,
            mode,
            labels,
            pad_id,
        })
    }

    /// The field that holds the token ids (empty while unresolved).
    pub fn field_name(&self) -> &str {
        self.field.as_deref().unwrap_or_default()
    }

    /// Token slots of one sequence: `seq_len + 1`.
    pub fn capacity(&self) -> usize {
        self.seq_len + 1
    }

    /// Tokens of each handed-out row (`input_ids`, `position_ids`):
    /// `seq_len` with `labels`, else `seq_len + 1`.
    pub fn width(&self) -> usize {
        if self.labels {
            self.seq_len
        } else {
            self.capacity()
        }
    }

    /// The mode's name: `"concat"` or `"best_fit"`.
    pub fn mode_name(&self) -> &'static str {
        match self.mode {
            PackMode::Concat => "concat",
            PackMode::BestFit { .. } => "best_fit",
        }
    }
}

impl fmt::Display for PackSpec {
    /// Every parameter, as the resume fingerprint takes them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Pack(seq_len={}, mode={:?}",
            self.seq_len,
            self.mode_name()
        )?;
        if let PackMode::BestFit { window } = self.mode {
            write!(f, ", window={window}")?;
        }
        if let Some(field) = &self.field {
            write!(f, ", field={field:?}")?;
        }
        let labels = if self.labels { "True" } else { "False" };
        write!(f, ", labels={labels}, pad_id={})", self.pad_id)
    }
}

/// One document's tokens `start..end` in a sequence.
#[derive(Debug, Clone)]
struct Piece {
    doc: SampleId,
    key: Arc<str>,
    url: Arc<str>,
    tokens: Arc<[i32]>,
    start: usize,
    end: usize,
}

impl Piece {
    fn len(&self) -> usize {
        self.end - self.start
    }
}

/// A sequence being filled, or filled and not handed out.
#[derive(Debug, Clone, Default)]
struct Bin {
    pieces: Vec<Piece>,
    used: usize,
}

impl Bin {
    fn add(&mut self, piece: Piece) {
        self.used += piece.len();
        self.pieces.push(piece);
    }

    /// Its pieces, as a state saves them.
    fn saved(&self) -> Vec<SavedPiece> {
        self.pieces
            .iter()
            .map(|p| {
                [
                    p.doc.shard as u64,
                    p.doc.index,
                    p.start as u64,
                    p.end as u64,
                ]
            })
            .collect()
    }
}

/// A piece of a document as a state holds it: `[shard, index, first
/// token, end token]`.
pub type SavedPiece = [u64; 4];

/// What a packer holds, in a saved state: the sequences filled (or closed)
/// and not handed out, in order, then the open ones, in order; each a list
/// of document pieces.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackState {
    /// Sequences to hand out next, in order.
    pub ready: Vec<Vec<SavedPiece>>,
    /// Sequences still open, in the order they were opened.
    pub open: Vec<Vec<SavedPiece>>,
}

impl PackState {
    /// Whether it holds no piece.
    pub fn is_empty(&self) -> bool {
        self.ready.is_empty() && self.open.is_empty()
    }

    /// The packers of several slots as one (an elastic resume gives each
    /// new slot those of some old slots): their ready sequences in order,
    /// then their open ones in order.
    pub fn merge(states: impl IntoIterator<Item = PackState>) -> PackState {
        let mut merged = PackState::default();
        for state in states {
            merged.ready.extend(state.ready);
            merged.open.extend(state.open);
        }
        merged
    }

    /// The documents its pieces come from, each once, in first-seen order.
    pub fn documents(&self) -> Vec<SampleId> {
        let mut seen = std::collections::HashSet::new();
        self.ready
            .iter()
            .chain(&self.open)
            .flatten()
            .map(|p| SampleId {
                shard: p[0] as usize,
                index: p[1],
            })
            .filter(|id| seen.insert(*id))
            .collect()
    }
}

/// Packs documents into sequences ([`PackSpec`]).
#[derive(Debug)]
pub struct Packer {
    spec: Arc<PackSpec>,
    ready: VecDeque<Bin>,
    open: Vec<Bin>,
    /// With `sample_ids`, the epoch: each sequence gets the `__id__` rows
    /// of the documents whose last token it holds.
    ids_epoch: Option<u64>,
    /// The documents have ended.
    finished: bool,
}

impl Packer {
    /// An empty packer.
    pub fn new(spec: Arc<PackSpec>) -> Self {
        Packer {
            spec,
            ready: VecDeque::new(),
            open: Vec::new(),
            ids_epoch: None,
            finished: false,
        }
    }

    /// Gives each sequence an `__id__` field: the `(epoch, shard, index)`
    /// rows (`int64`, `(K, 3)`) of the documents whose last token it holds,
    /// so that each document of the epoch is in exactly one sequence's ids.
    /// A document with no tokens rides in the open sequence, or in the last
    /// one filled, which is then held until the next document or the end.
    pub fn with_ids(mut self, epoch: u64) -> Self {
        self.ids_epoch = Some(epoch);
        self
    }

    /// Whether it holds nothing (no sequence ready, none open).
    pub fn is_empty(&self) -> bool {
        self.ready.is_empty() && self.open.is_empty()
    }

    /// Takes the next document. `Err` when it lacks the field or the field
    /// is not 1-D integer token ids (a message naming the document).
    /// Gives the document's token count.
    pub fn push(&mut self, doc: &Sample) -> Result<usize> {
        let tokens = tokens_of(doc, self.spec.field_name())?;
        let count = tokens.len();
        self.push_tokens(
            doc.id,
            Arc::from(doc.key.as_str()),
            doc.url.clone(),
            tokens,
            0,
        );
        Ok(count)
    }

    /// Takes tokens `from..` of a document (a whole document from 0; a
    /// piece of one when open sequences of several packers are merged).
    fn push_tokens(
        &mut self,
        doc: SampleId,
        key: Arc<str>,
        url: Arc<str>,
        tokens: Arc<[i32]>,
        from: usize,
    ) {
        if tokens.len() <= from {
            if tokens.is_empty() && self.ids_epoch.is_some() {
                self.home_empty(Piece {
                    doc,
                    key,
                    url,
                    tokens,
                    start: 0,
                    end: 0,
                });
            }
            return;
        }
        let capacity = self.spec.capacity();
        let piece = |start, end| Piece {
            doc,
            key: key.clone(),
            url: url.clone(),
            tokens: tokens.clone(),
            start,
            end,
        };
        match self.spec.mode {
            PackMode::Concat => {
                let mut start = from;
                while start < tokens.len() {
                    if self.open.is_empty() {
                        self.open.push(Bin::default());
                    }
                    let bin = &mut self.open[0];
                    let end = tokens.len().min(start + capacity - bin.used);
                    bin.add(piece(start, end));
                    start = end;
                    if bin.used == capacity {
                        let full = self.open.remove(0);
                        self.ready.push_back(full);
                    }
                }
            }
            PackMode::BestFit { window } => {
                let mut start = from;
                // A document longer than a sequence: whole sequences of it
                // first, then its rest placed like a document.
                while tokens.len() - start > capacity {
                    let mut bin = Bin::default();
                    bin.add(piece(start, start + capacity));
                    self.ready.push_back(bin);
                    start += capacity;
                }
                let len = tokens.len() - start;
                if len == 0 {
                    return;
                }
                let best = self
                    .open
                    .iter()
                    .enumerate()
                    .filter(|(_, b)| capacity - b.used >= len)
                    .min_by_key(|(at, b)| (capacity - b.used, *at))
                    .map(|(at, _)| at);
                let at = match best {
                    Some(at) => at,
                    None => {
                        if self.open.len() >= window {
                            self.close_fullest();
                        }
                        self.open.push(Bin::default());
                        self.open.len() - 1
                    }
                };
                self.open[at].add(piece(start, tokens.len()));
                if self.open[at].used == capacity {
                    let full = self.open.remove(at);
                    self.ready.push_back(full);
                }
            }
        }
    }

    /// Places a document with no tokens: in the last open sequence, else in
    /// the last one filled (held by [`Packer::pop`]), else in a new open one.
    fn home_empty(&mut self, piece: Piece) {
        if let Some(bin) = self.open.last_mut() {
            bin.add(piece);
        } else if let Some(bin) = self.ready.back_mut() {
            bin.add(piece);
        } else {
            let mut bin = Bin::default();
            bin.add(piece);
            self.open.push(bin);
        }
    }

    /// Hands out the fullest open sequence (the first opened among equals).
    fn close_fullest(&mut self) {
        let fullest = self
            .open
            .iter()
            .enumerate()
            .max_by_key(|(at, b)| (b.used, std::cmp::Reverse(*at)))
            .map(|(at, _)| at);
        if let Some(at) = fullest {
            let bin = self.open.remove(at);
            self.ready.push_back(bin);
        }
    }

    /// The stream ended: every open sequence is handed out, padded, in the
    /// order they were opened. Returns the documents no sequence carries:
    /// those with no tokens, when the packer held nothing else (a sequence
    /// of padding only would give a loss of no tokens), in the order taken.
    pub fn finish(&mut self) -> Vec<SampleId> {
        self.finished = true;
        self.ready.extend(self.open.drain(..));
        // A sequence of documents with no tokens only: they join the one
        // before (or after) it; a packer that held nothing else has no
        // sequence to give them.
        let mut carried_by_none = Vec::new();
        while let Some(at) = self.ready.iter().position(|b| b.used == 0) {
            let Some(bin) = self.ready.remove(at) else {
                break;
            };
            let next = if at > 0 { at - 1 } else { 0 };
            match self.ready.get_mut(next) {
                Some(other) => other.pieces.extend(bin.pieces),
                None => carried_by_none.extend(bin.pieces.iter().map(|p| p.doc)),
            }
        }
        carried_by_none
    }

    /// The next sequence, if one is filled (or closed).
    pub fn pop(&mut self) -> Option<Sample> {
        let bin = self.pop_bin()?;
        Some(self.sequence(bin))
    }

    /// The pieces of the next sequence, if one is filled (or closed),
    /// without making it.
    pub fn pop_pieces(&mut self) -> Option<Vec<SavedPiece>> {
        self.pop_bin().map(|bin| bin.saved())
    }

    fn pop_bin(&mut self) -> Option<Bin> {
        // With ids, the last sequence filled waits while none is open: a
        // document with no tokens may still join it.
        let held = self.ids_epoch.is_some() && !self.finished && self.open.is_empty();
        if held && self.ready.len() == 1 {
            return None;
        }
        self.ready.pop_front()
    }

    /// What the packer holds, as a state saves it.
    pub fn state(&self) -> PackState {
        PackState {
            ready: self.ready.iter().map(Bin::saved).collect(),
            open: self.open.iter().map(Bin::saved).collect(),
        }
    }

    /// The packer a state describes, from its documents read again
    /// (`docs`, by id). `Error::StateMismatch` naming the field when a
    /// piece does not fit its document or a sequence. Open sequences
    /// beyond what the mode keeps open (the packers of several slots,
    /// merged at an elastic resume: [`PackState::merge`]) have their pieces
    /// packed again, in order, as documents are.
    pub fn restore(mut self, saved: &PackState, docs: &HashMap<SampleId, Sample>) -> Result<Self> {
        let spec = self.spec.clone();
        let capacity = spec.capacity();
        let mut tokens: HashMap<SampleId, Arc<[i32]>> = HashMap::new();
        let mut bin_of = |pieces: &[SavedPiece], field: &str| -> Result<Bin> {
            let mut bin = Bin::default();
            for (at, &[shard, index, start, end]) in pieces.iter().enumerate() {
                let bad = |reason: String| {
                    Error::StateMismatch(format!("state field {field}[{at}]: {reason}"))
                };
                let doc = SampleId {
                    shard: usize::try_from(shard).map_err(|_| bad("no such shard".into()))?,
                    index,
                };
                let sample = docs.get(&doc).ok_or_else(|| {
                    bad(format!(
                        "sample {index} of shard {shard} was not read again"
                    ))
                })?;
                let ids = match tokens.get(&doc) {
                    Some(ids) => ids.clone(),
                    None => {
                        let ids = tokens_of(sample, spec.field_name())?;
                        tokens.insert(doc, ids.clone());
                        ids
                    }
                };
                // A document with no tokens is held as its one empty piece.
                let empty = ids.is_empty() && (start, end) == (0, 0);
                if !((start < end || empty) && end <= ids.len() as u64) {
                    return Err(bad(format!(
                        "tokens {start}..{end} of a document of {} tokens",
                        ids.len()
                    )));
                }
                bin.add(Piece {
                    doc,
                    key: Arc::from(sample.key.as_str()),
                    url: sample.url.clone(),
                    tokens: ids,
                    start: start as usize,
                    end: end as usize,
                });
                if bin.used > capacity {
                    return Err(bad(format!(
                        "the sequence holds more than seq_len + 1 = {capacity} tokens"
                    )));
                }
            }
            if bin.pieces.is_empty() {
                return Err(Error::StateMismatch(format!(
                    "state field {field}: an empty sequence"
                )));
            }
            Ok(bin)
        };
        let packer = &mut self;
        for (at, pieces) in saved.ready.iter().enumerate() {
            let bin = bin_of(pieces, &format!("pack.ready[{at}]"))?;
            packer.ready.push_back(bin);
        }
        let mut open = Vec::with_capacity(saved.open.len());
        for (at, pieces) in saved.open.iter().enumerate() {
            let bin = bin_of(pieces, &format!("pack.open[{at}]"))?;
            if bin.used >= capacity {
                return Err(Error::StateMismatch(format!(
                    "state field pack.open[{at}]: an open sequence is full"
                )));
            }
            open.push(bin);
        }
        let most = match spec.mode {
            PackMode::Concat => 1,
            PackMode::BestFit { window } => window,
        };
        if open.len() <= most {
            packer.open = open;
        } else {
            for piece in open.into_iter().flat_map(|bin| bin.pieces) {
                let Piece {
                    doc,
                    key,
                    url,
                    tokens,
                    start,
                    end,
                } = piece;
                let tokens: Arc<[i32]> = if end == tokens.len() {
                    tokens
                } else {
                    Arc::from(&tokens[..end])
                };
                packer.push_tokens(doc, key, url, tokens, start);
            }
        }
        Ok(self)
    }

    /// A sequence's sample: `input_ids` (and `labels`), `position_ids`
    /// restarting at each piece, `cu_seqlens` (each piece's start, then the
    /// padding's, then the end).
    fn sequence(&self, bin: Bin) -> Sample {
        let spec = &self.spec;
        let capacity = spec.capacity();
        let mut tokens = Vec::with_capacity(capacity);
        let mut positions: Vec<i32> = Vec::with_capacity(capacity);
        let mut bounds = vec![0i32];
        let mut ids = Vec::new();
        for piece in &bin.pieces {
            if let Some(epoch) = self.ids_epoch.filter(|_| piece.end == piece.tokens.len()) {
                let id = piece.doc;
                ids.extend([epoch, id.shard as u64, id.index].map(|n| n as i64));
            }
            if piece.len() == 0 {
                continue;
            }
            tokens.extend_from_slice(&piece.tokens[piece.start..piece.end]);
            positions.extend(0..piece.len() as i32);
            bounds.push(tokens.len() as i32);
        }
        let used = tokens.len();
        tokens.resize(capacity, spec.pad_id);
        positions.extend(0..(capacity - used) as i32);
        if used < capacity {
            bounds.push(capacity as i32);
        }
        let width = spec.width();
        let mut fields = Vec::with_capacity(4);
        if spec.labels {
            let labels = (1..capacity)
                .map(|next| {
                    if next < used {
                        tokens[next]
                    } else {
                        IGNORE_LABEL
                    }
                })
                .collect::<Vec<_>>();
            tokens.truncate(width);
            fields.push(("input_ids".to_owned(), int32_array(tokens)));
            fields.push(("labels".to_owned(), int32_array(labels)));
        } else {
            fields.push(("input_ids".to_owned(), int32_array(tokens)));
        }
        positions.truncate(width);
        for bound in &mut bounds {
            *bound = (*bound).min(width as i32);
        }
        bounds.dedup();
        fields.push(("position_ids".to_owned(), int32_array(positions)));
        fields.push(("cu_seqlens".to_owned(), int32_array(bounds)));
        if let Some(epoch) = self.ids_epoch {
            let rows = ids.len() / 3;
            fields.push((
                SAMPLE_ID_FIELD.to_owned(),
                Value::Array(Array {
                    shape: vec![rows, 3],
                    data: ArrayData::I64(ids),
                }),
            ));
            fields.push((
                SEQUENCE_EPOCH_FIELD.to_owned(),
                Value::Array(Array {
                    shape: vec![1],
                    data: ArrayData::I64(vec![epoch as i64]),
                }),
            ));
        }
        let (id, key, url) = match bin.pieces.first() {
            Some(first) => (
                first.doc,
                format!("{}@{}", first.key, first.start),
                first.url.clone(),
            ),
            None => (
                SampleId { shard: 0, index: 0 },
                PADDING_KEY.to_owned(),
                Arc::from(""),
            ),
        };
        Sample {
            id,
            key,
            url,
            fields,
            offset: 0,
            length: 0,
        }
    }

    /// A sequence of padding only (every label [`IGNORE_LABEL`], no
    /// document), keyed [`PADDING_KEY`]: what fills a slot's planned
    /// sequences up when documents were skipped.
    pub fn padding(&self) -> Sample {
        self.sequence(Bin::default())
    }
}

/// The `__key__` of a sequence of padding only ([`Packer::padding`]).
pub const PADDING_KEY: &str = "padding";

/// A 1-D `int32` array value.
fn int32_array(values: Vec<i32>) -> Value {
    Value::Array(Array {
        shape: vec![values.len()],
        data: ArrayData::I32(values),
    })
}

/// How many token ids `doc`'s `field` holds (what `shardstream index
/// --count-tokens` records), or the error packing it would give.
pub fn token_count(doc: &Sample, field: &str) -> Result<usize> {
    tokens_of(doc, field).map(|tokens| tokens.len())
}

/// The token ids of `doc`'s `field`: a 1-D integer array, or a list of
/// ints, each within `int32`.
fn tokens_of(doc: &Sample, field: &str) -> Result<Arc<[i32]>> {
    let bad = |reason: String| Error::Decode {
        url: doc.url.to_string(),
        key: doc.key.clone(),
        field: field.to_owned(),
        decoder: "Pack",
        reason,
    };
    let value = doc
        .fields
        .iter()
        .find(|(name, _)| name == field)
        .map(|(_, v)| v)
        .ok_or_else(|| {
            bad("the document has no such field to pack (pack=Pack(field=...))".into())
        })?;
    let out_of_range = |v: i128| bad(format!("token id {v} is outside int32"));
    let narrow = |v: i128| i32::try_from(v).map_err(|_| out_of_range(v));
    match value {
        Value::Array(array) if array.shape.len() == 1 => match &array.data {
            ArrayData::I32(ids) => Ok(Arc::from(ids.as_slice())),
            ArrayData::U8(v) => Ok(v.iter().map(|&x| i32::from(x)).collect()),
            ArrayData::I8(v) => Ok(v.iter().map(|&x| i32::from(x)).collect()),
            ArrayData::U16(v) => Ok(v.iter().map(|&x| i32::from(x)).collect()),
            ArrayData::I16(v) => Ok(v.iter().map(|&x| i32::from(x)).collect()),
            ArrayData::U32(v) => v.iter().map(|&x| narrow(i128::from(x))).collect(),
            ArrayData::U64(v) => v.iter().map(|&x| narrow(i128::from(x))).collect(),
            ArrayData::I64(v) => v.iter().map(|&x| narrow(i128::from(x))).collect(),
            other => Err(bad(format!(
                "token ids must be integers, not {}",
                other.dtype()
            ))),
        },
        Value::Array(array) => Err(bad(format!(
            "token ids must be a 1-D array, not of shape {:?}",
            array.shape
        ))),
        Value::List(items) => items
            .iter()
            .map(|item| match item {
                Value::Int(v) => narrow(i128::from(*v)),
                Value::UInt(v) => narrow(i128::from(*v)),
                _ => Err(bad("token ids must be a list of ints".into())),
            })
            .collect(),
        _ => Err(bad(
            "the field is not token ids (a 1-D integer array or a list of ints: decode it \
             with a shardstream.Tokenizer)"
                .into(),
        )),
    }
}

/// The most tokens of a document [`lay_out`] lays (a count from a
/// manifest, which a damaged one could make any size): 256 MiB of ids.
pub const MAX_LAID_TOKENS: u64 = 1 << 26;

/// The sequences a packed stream by `spec` hands out of `documents` (each
/// with its token count) in the order they reach its packer, as the pieces
/// of each: the stream takes a sequence whenever one is ready, and stops
/// after `sequences` (across ranks, the planned ones) or when the
/// documents end, its open sequences then handed out. Where the packer
/// lays a document depends on its count alone, so each is laid as zeros.
/// The packer gives ids (`sample_ids=True`): a document without tokens is
/// a piece of the sequence it joins (without ids the packer drops it, the
/// sequences' tokens the same). `None` when a document holds more than
/// [`MAX_LAID_TOKENS`].
pub fn lay_out(
    documents: impl IntoIterator<Item = (SampleId, u64)>,
    spec: &PackSpec,
    sequences: Option<u64>,
) -> Option<Vec<Vec<SavedPiece>>> {
    let mut packer = Packer::new(Arc::new(spec.clone())).with_ids(0);
    let mut documents = documents.into_iter();
    let (key, url): (Arc<str>, Arc<str>) = (Arc::from(""), Arc::from(""));
    let mut out = Vec::new();
    while sequences.is_none_or(|n| (out.len() as u64) < n) {
        if let Some(pieces) = packer.pop_pieces() {
            out.push(pieces);
            continue;
        }
        match documents.next() {
            Some((_, count)) if count > MAX_LAID_TOKENS => return None,
            Some((doc, count)) => {
                let zeros: Arc<[i32]> = vec![0; count as usize].into();
                packer.push_tokens(doc, key.clone(), url.clone(), zeros, 0);
            }
            None if packer.is_empty() => break,
            None => {
                packer.finish();
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(seq_len: usize, mode: PackMode, labels: bool) -> Arc<PackSpec> {
        Arc::new(PackSpec::new(Some("ids".into()), seq_len, mode, labels, -1).unwrap())
    }

    /// Document `i` of `len` tokens: ids `i * 1000 + t`.
    fn doc(i: u64, len: usize) -> Sample {
        let ids = (0..len as i32).map(|t| i as i32 * 1000 + t).collect();
        Sample {
            id: SampleId { shard: 0, index: i },
            key: format!("d{i}"),
            url: Arc::from("mem://x"),
            fields: vec![("ids".into(), int32_array(ids))],
            offset: 0,
            length: 0,
        }
    }

    fn field<'a>(sample: &'a Sample, name: &str) -> &'a [i32] {
        match sample
            .fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
        {
            Some(Value::Array(Array {
                data: ArrayData::I32(v),
                ..
            })) => v,
            other => panic!("{name}: {other:?}"),
        }
    }

    /// The tokens of documents of `lens`, in order ([`doc`]'s ids).
    fn every_token(lens: &[usize]) -> Vec<i32> {
        lens.iter()
            .enumerate()
            .flat_map(|(i, &len)| (0..len as i32).map(move |t| i as i32 * 1000 + t))
            .collect()
    }

    /// Every sequence of `lens`, packed.
    fn pack_all(spec: &Arc<PackSpec>, lens: &[usize]) -> Vec<Sample> {
        let mut packer = Packer::new(spec.clone());
        let mut out = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            packer.push(&doc(i as u64, len)).unwrap();
            out.extend(std::iter::from_fn(|| packer.pop()));
        }
        packer.finish();
        out.extend(std::iter::from_fn(|| packer.pop()));
        out
    }

    /// Every sequence of `lens` by packers `make` makes: the first takes
    /// `cut` documents (with `hold`, the sequences the last one filled stay
    /// held), a second is restored from its state and takes the rest; and
    /// the documents no sequence carries ([`Packer::finish`]).
    fn pack_across_restore(
        make: impl Fn() -> Packer,
        lens: &[usize],
        cut: usize,
        hold: bool,
    ) -> (Vec<Sample>, Vec<SampleId>) {
        let cut = cut.min(lens.len());
        let mut packer = make();
        let mut out = Vec::new();
        for (i, &len) in lens[..cut].iter().enumerate() {
            packer.push(&doc(i as u64, len)).unwrap();
            if !hold || i + 1 < cut {
                out.extend(std::iter::from_fn(|| packer.pop()));
            }
        }
        let state = packer.state();
        let docs: HashMap<_, _> = state
            .documents()
            .into_iter()
            .map(|id| (id, doc(id.index, lens[id.index as usize])))
            .collect();
        let mut packer = make().restore(&state, &docs).unwrap();
        assert_eq!(packer.state(), state);
        for (i, &len) in lens.iter().enumerate().skip(cut) {
            packer.push(&doc(i as u64, len)).unwrap();
            out.extend(std::iter::from_fn(|| packer.pop()));
        }
        let carried_by_none = packer.finish();
        out.extend(std::iter::from_fn(|| packer.pop()));
        (out, carried_by_none)
    }

    /// The tokens of each sequence (inputs and, with labels, the last label).
    fn real_tokens(spec: &PackSpec, seq: &Sample) -> Vec<i32> {
        let mut tokens = field(seq, "input_ids").to_vec();
        if spec.labels {
            let last = *field(seq, "labels").last().unwrap();
            tokens.push(if last == IGNORE_LABEL {
                spec.pad_id
            } else {
                last
            });
        }
        // Padding ends the sequence when it is not full (no test token
        // is the padding id).
        let pad_from = tokens
            .iter()
            .rposition(|&t| t != spec.pad_id)
            .map_or(0, |p| p + 1);
        tokens.truncate(pad_from);
        tokens
    }

    #[test]
    fn concat_splits_documents_across_sequences() {
        let spec = spec(4, PackMode::Concat, false);
        let seqs = pack_all(&spec, &[3, 4, 1]);
        let ids: Vec<&[i32]> = seqs.iter().map(|s| field(s, "input_ids")).collect();
        assert_eq!(
            ids,
            [&[0, 1, 2, 1000, 1001][..], &[1002, 1003, 2000, -1, -1][..]]
        );
        assert_eq!(field(&seqs[0], "position_ids"), [0, 1, 2, 0, 1]);
        assert_eq!(field(&seqs[0], "cu_seqlens"), [0, 3, 5]);
        assert_eq!(field(&seqs[1], "position_ids"), [0, 1, 0, 0, 1]);
        assert_eq!(field(&seqs[1], "cu_seqlens"), [0, 2, 3, 5]);
        assert_eq!(seqs[1].key, "d1@2");
    }

    #[test]
    fn labels_are_the_next_token_and_ignored_before_padding() {
        let spec = spec(4, PackMode::Concat, true);
        let seqs = pack_all(&spec, &[3, 4, 1]);
        assert_eq!(field(&seqs[0], "input_ids"), [0, 1, 2, 1000]);
        assert_eq!(field(&seqs[0], "labels"), [1, 2, 1000, 1001]);
        assert_eq!(field(&seqs[0], "cu_seqlens"), [0, 3, 4]);
        assert_eq!(field(&seqs[1], "input_ids"), [1002, 1003, 2000, -1]);
        assert_eq!(field(&seqs[1], "labels"), [1003, 2000, -100, -100]);
        assert_eq!(field(&seqs[1], "cu_seqlens"), [0, 2, 3, 4]);
    }

    #[test]
    fn best_fit_keeps_documents_whole_and_fills_the_tightest_room() {
        let spec = spec(9, PackMode::BestFit { window: 2 }, false);
        // 10 slots: 6 opens a, 5 opens b, 4 fits a (room 4), 5 fills b.
        let seqs = pack_all(&spec, &[6, 5, 4, 5]);
        let docs = |s: &Sample| {
            field(s, "input_ids")
                .iter()
                .map(|t| t / 1000)
                .collect::<Vec<_>>()
        };
        assert_eq!(docs(&seqs[0]), [0, 0, 0, 0, 0, 0, 2, 2, 2, 2]);
        assert_eq!(docs(&seqs[1]), [1, 1, 1, 1, 1, 3, 3, 3, 3, 3]);
        // A document longer than a sequence: whole sequences of it first.
        let seqs = pack_all(&spec, &[23]);
        assert_eq!(seqs.len(), 3);
        assert_eq!(field(&seqs[2], "cu_seqlens"), [0, 3, 10]);
    }

    #[test]
    fn best_fit_hands_out_the_fullest_when_the_window_is_full() {
        let spec = spec(9, PackMode::BestFit { window: 2 }, false);
        let mut packer = Packer::new(spec);
        for (i, len) in [7, 8, 9].into_iter().enumerate() {
            packer.push(&doc(i as u64, len)).unwrap();
        }
        let out = packer.pop().unwrap();
        assert_eq!(field(&out, "cu_seqlens"), [0, 8, 10]);
        assert!(packer.pop().is_none());
        assert_eq!(packer.state().open.len(), 2);
    }

    #[test]
    fn a_field_that_is_not_token_ids_is_named() {
        let mut packer = Packer::new(spec(4, PackMode::Concat, false));
        let mut d = doc(0, 3);
        d.fields = vec![("ids".into(), Value::Str("text".into()))];
        let message = packer.push(&d).unwrap_err().to_string();
        assert!(
            message.contains("ids") && message.contains("Tokenizer"),
            "{message}"
        );
        d.fields.clear();
        assert!(packer
            .push(&d)
            .unwrap_err()
            .to_string()
            .contains("no such field"));
    }

    #[test]
    fn a_state_whose_pieces_do_not_fit_is_refused_by_field() {
        let spec = spec(4, PackMode::Concat, false);
        let docs: HashMap<_, _> = [(SampleId { shard: 0, index: 0 }, doc(0, 3))].into();
        let bad = |ready: Vec<Vec<SavedPiece>>, open: Vec<Vec<SavedPiece>>| {
            Packer::new(spec.clone())
                .restore(&PackState { ready, open }, &docs)
                .unwrap_err()
                .to_string()
        };
        assert!(bad(vec![vec![[0, 0, 1, 4]]], vec![]).contains("pack.ready[0][0]"));
        assert!(bad(vec![], vec![vec![[0, 1, 0, 1]]]).contains("not read again"));
        assert!(bad(vec![vec![]], vec![]).contains("empty sequence"));
    }

    proptest! {
        /// `lay_out` gives the pieces of the sequences a stream's packer
        /// with ids hands out (fed its documents, a sequence taken when
        /// ready, at most `sequences`): each sequence's tokens are its
        /// pieces' tokens, in order, documents without tokens included.
        #[test]
        fn lay_out_gives_the_pieces_of_the_sequences_handed_out(
            lens in proptest::collection::vec(prop_oneof![Just(0usize), 1usize..30], 0..30),
            seq_len in 1usize..9,
            mode in mode_strategy(),
            limit in proptest::option::of(0u64..12),
        ) {
            let spec = Arc::new(PackSpec::new(Some("ids".into()), seq_len, mode, false, -1).unwrap());
            let mut packer = Packer::new(spec.clone()).with_ids(0);
            let mut docs = lens.iter().enumerate();
            let mut handed = Vec::new();
            while limit.is_none_or(|n| (handed.len() as u64) < n) {
                if let Some(sequence) = packer.pop() {
                    handed.push(sequence);
                    continue;
                }
                match docs.next() {
                    Some((i, &len)) => {
                        packer.push(&doc(i as u64, len)).unwrap();
                    }
                    None if packer.is_empty() => break,
                    None => {
                        packer.finish();
                    }
                }
            }
            let documents = lens
                .iter()
                .enumerate()
                .map(|(i, &len)| (SampleId { shard: 0, index: i as u64 }, len as u64));
            let laid = lay_out(documents, &spec, limit).unwrap();
            prop_assert_eq!(laid.len(), handed.len());
            for (pieces, sequence) in laid.iter().zip(&handed) {
                let tokens: Vec<i32> = pieces
                    .iter()
                    .flat_map(|&[_, i, a, b]| (a as i32..b as i32).map(move |t| i as i32 * 1000 + t))
                    .collect();
                let real: Vec<i32> =
                    field(sequence, "input_ids").iter().copied().filter(|&t| t != -1).collect();
                prop_assert_eq!(tokens, real);
                // The documents it ends are those its ids name.
                let ended: Vec<u64> = pieces
                    .iter()
                    .filter(|p| p[3] == lens[p[1] as usize] as u64)
                    .map(|p| p[1])
                    .collect();
                let named: Vec<u64> = match sequence.fields.iter().find(|(n, _)| n == SAMPLE_ID_FIELD) {
                    Some((_, Value::Array(Array { data: ArrayData::I64(rows), .. }))) => {
                        rows.chunks(3).map(|r| r[2] as u64).collect()
                    }
                    other => panic!("ids: {other:?}"),
                };
                prop_assert_eq!(ended, named);
            }
        }
    }

    fn mode_strategy() -> impl Strategy<Value = PackMode> {
        prop_oneof![
            Just(PackMode::Concat),
            (1usize..6).prop_map(|window| PackMode::BestFit { window }),
        ]
    }

    proptest! {
        /// A packer makes at least `ceil(tokens / (seq_len + 1))` sequences
        /// in either mode (exactly that under "concat"): the bound packing
        /// across ranks plans each slot's sequences with
        /// ([`crate::text::counts`]), which every slot can then hand out.
        #[test]
        fn a_packer_makes_at_least_the_sequences_its_tokens_fill(
            lens in prop::collection::vec(0usize..60, 0..40),
            seq_len in 1usize..24,
            mode in mode_strategy(),
        ) {
            let spec = spec(seq_len, mode, false);
            let made = pack_all(&spec, &lens).len() as u64;
            let tokens: u64 = lens.iter().map(|&n| n as u64).sum();
            let bound = tokens.div_ceil(spec.capacity() as u64);
            prop_assert!(made >= bound, "{} sequences, {} planned", made, bound);
            if mode == PackMode::Concat {
                prop_assert_eq!(made, bound);
            }
        }

        /// Every token comes once: in order under "concat"; each document
        /// whole (or in whole sequences and one rest) under "best_fit".
        /// Every sequence has the same shape; its bounds cover it.
        #[test]
        fn every_token_comes_once(
            lens in prop::collection::vec(0usize..40, 0..30),
            seq_len in 1usize..16,
            mode in mode_strategy(),
            labels in any::<bool>(),
        ) {
            let spec = spec(seq_len, mode, labels);
            let seqs = pack_all(&spec, &lens);
            let width = if labels { seq_len } else { seq_len + 1 };
            let mut seen = Vec::new();
            for seq in &seqs {
                prop_assert_eq!(field(seq, "input_ids").len(), width);
                prop_assert_eq!(field(seq, "position_ids").len(), width);
                let bounds = field(seq, "cu_seqlens");
                prop_assert_eq!(bounds[0], 0);
                prop_assert_eq!(*bounds.last().unwrap(), width as i32);
                prop_assert!(bounds.windows(2).all(|w| w[0] < w[1]));
                seen.push(real_tokens(&spec, seq));
            }
            let want = every_token(&lens);
            let mut all: Vec<i32> = seen.iter().flatten().copied().collect();
            if mode == PackMode::Concat {
                prop_assert_eq!(all, want);
            } else {
                all.sort_unstable();
                let mut want = want;
                want.sort_unstable();
                prop_assert_eq!(all, want);
                // No document's rest is split: each sequence's pieces hold
                // runs of consecutive tokens of distinct documents.
                for tokens in &seen {
                    let mut docs: Vec<i32> = tokens.iter().map(|t| t / 1000).collect();
                    docs.dedup();
                    let mut sorted = docs.clone();
                    sorted.sort_unstable();
                    sorted.dedup();
                    prop_assert_eq!(docs.len(), sorted.len());
                }
            }
            // Only the last sequence of "concat" is padded.
            if mode == PackMode::Concat && seqs.len() > 1 {
                for seq in &seqs[..seqs.len() - 1] {
                    prop_assert_eq!(real_tokens(&spec, seq).len(), seq_len + 1);
                }
            }
        }

        /// With ids, each document (those with no tokens too) is in exactly
        /// one sequence's `__id__`, the one with its last token, also across
        /// a restore at any point; the tokens are those without ids. Only
        /// when no document has a token is none carried: `finish` returns
        /// them all.
        #[test]
        fn each_document_is_in_one_sequences_ids(
            lens in prop::collection::vec(0usize..40, 1..25),
            seq_len in 1usize..16,
            mode in mode_strategy(),
            cut in 0usize..25,
        ) {
            let spec = spec(seq_len, mode, false);
            let plain = pack_all(&spec, &lens);
            let (out, carried_by_none) =
                pack_across_restore(|| Packer::new(spec.clone()).with_ids(3), &lens, cut, false);
            let tokens = |seqs: &[Sample]| -> Vec<Vec<i32>> {
                seqs.iter().map(|s| field(s, "input_ids").to_vec()).collect()
            };
            prop_assert_eq!(tokens(&out), tokens(&plain));
            let mut ids = Vec::new();
            for seq in &out {
                match seq.fields.iter().find(|(n, _)| n == "__id__").map(|(_, v)| v) {
                    Some(Value::Array(Array { shape, data: ArrayData::I64(rows) })) => {
                        prop_assert_eq!(shape[1], 3);
                        for row in rows.chunks(3) {
                            prop_assert_eq!((row[0], row[1]), (3, 0));
                            ids.push(row[2] as usize);
                        }
                    }
                    other => prop_assert!(false, "{:?}", other),
                }
            }
            ids.sort_unstable();
            let every: Vec<usize> = (0..lens.len()).collect();
            let none_carried: Vec<usize> = carried_by_none.iter().map(|d| d.index as usize).collect();
            if lens.iter().all(|&l| l == 0) {
                prop_assert!(out.is_empty());
                prop_assert_eq!(none_carried, every);
            } else {
                prop_assert_eq!(ids, every);
                prop_assert!(none_carried.is_empty());
            }
        }

        /// The packers of several slots, merged (an elastic resume) and
        /// restored, hand out every token they held and every later one
        /// exactly once.
        #[test]
        fn merged_packers_give_every_token_once(
            lens in prop::collection::vec(1usize..40, 1..25),
            seq_len in 1usize..16,
            mode in mode_strategy(),
            slots in 1usize..4,
            cut in 0usize..25,
        ) {
            let spec = spec(seq_len, mode, false);
            let cut = cut.min(lens.len());
            let mut out = Vec::new();
            let mut states = Vec::new();
            for slot in 0..slots {
                let mut packer = Packer::new(spec.clone());
                for (i, &len) in lens[..cut].iter().enumerate().filter(|(i, _)| i % slots == slot) {
                    packer.push(&doc(i as u64, len)).unwrap();
                    if packer.ready.len() > 1 {
                        out.extend(packer.pop());
                    }
                }
                states.push(packer.state());
            }
            let merged = PackState::merge(states);
            let docs: HashMap<_, _> = merged
                .documents()
                .into_iter()
                .map(|id| (id, doc(id.index, lens[id.index as usize])))
                .collect();
            let mut packer = Packer::new(spec.clone()).restore(&merged, &docs).unwrap();
            let reopened = Packer::new(spec.clone()).restore(&packer.state(), &docs).unwrap();
            prop_assert_eq!(reopened.state(), packer.state());
            for (i, &len) in lens.iter().enumerate().skip(cut) {
                packer.push(&doc(i as u64, len)).unwrap();
            }
            packer.finish();
            out.extend(std::iter::from_fn(|| packer.pop()));
            let mut all: Vec<i32> = out.iter().flat_map(|s| real_tokens(&spec, s)).collect();
            all.sort_unstable();
            let mut want = every_token(&lens);
            want.sort_unstable();
            prop_assert_eq!(all, want);
        }

        /// A packer restored from its state at any point hands out what the
        /// uninterrupted one would have.
        #[test]
        fn a_restored_packer_continues_exactly(
            lens in prop::collection::vec(1usize..40, 1..25),
            seq_len in 1usize..16,
            mode in mode_strategy(),
            cut in 0usize..25,
        ) {
            let spec = spec(seq_len, mode, true);
            let whole = pack_all(&spec, &lens);
            let (out, _) = pack_across_restore(|| Packer::new(spec.clone()), &lens, cut, true);
            prop_assert_eq!(out, whole);
        }
    }
}
