//! The packing stage of a slot's stream (the `pack` option): the documents
//! the pipeline hands out go through a [`Packer`], and the stream hands out
//! its sequences. A resumed stream first receives, read again, the
//! documents the saved packer held (the pipeline sends them before any
//! other sample, outside the mirror: they were handed out before the save),
//! and rebuilds the packer from them.
//!
//! Across ranks the stage hands out the number of sequences planned for
//! the slot ([`crate::text::counts`]) and no more, filling up with padding
//! only if documents were skipped; each document's token count is checked
//! against the manifest's as it is packed.

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::{Sample, SampleId};
use crate::shard::ShardTokens;
use crate::text::pack::{PackSpec, PackState, Packer};

/// A packed stream across ranks: the sequences it still hands out, and the
/// manifest's token counts its documents are checked against.
#[derive(Debug)]
pub(super) struct Planned {
    /// Sequences still to hand out this epoch.
    pub(super) left: u64,
    /// Each shard's token counts, by shard index.
    pub(super) counts: Vec<Option<Arc<ShardTokens>>>,
}

/// The saved packer being rebuilt: its documents arrive first.
#[derive(Debug)]
struct Rebuild {
    saved: PackState,
    /// Documents still to arrive.
    left: usize,
    docs: HashMap<SampleId, Sample>,
}

/// A stream's packer, and where it stands.
#[derive(Debug)]
pub(super) struct PackStage {
    spec: Arc<PackSpec>,
    ids_epoch: Option<u64>,
    packer: Packer,
    rebuild: Option<Rebuild>,
    /// The documents have ended: no more come.
    ended: bool,
    /// A document could not be packed (or the saved packer rebuilt): the
    /// stream ends there.
    failed: bool,
    /// Across ranks: the sequences planned, and the counts to check.
    planned: Option<Planned>,
}

impl PackStage {
    /// A stage packing by `spec` (with the documents' ids of `ids_epoch`,
    /// when given: `sample_ids`), rebuilding `saved` first when given, and
    /// handing out only the sequences `planned` (across ranks). A stage
    /// with none left rebuilds nothing.
    pub(super) fn new(
        spec: Arc<PackSpec>,
        saved: Option<PackState>,
        ids_epoch: Option<u64>,
        planned: Option<Planned>,
    ) -> Self {
        let none_left = planned.as_ref().is_some_and(|p| p.left == 0);
        let rebuild = saved
            .filter(|s| !s.is_empty() && !none_left)
            .map(|saved| Rebuild {
                left: saved.documents().len(),
                saved,
                docs: HashMap::new(),
            });
        PackStage {
            packer: empty_packer(&spec, ids_epoch),
            spec,
            ids_epoch,
            rebuild,
            ended: false,
            failed: false,
            planned,
        }
    }

    /// Whether the sequences planned are all handed out.
    fn none_left(&self) -> bool {
        self.planned.as_ref().is_some_and(|p| p.left == 0)
    }

    /// The documents to read again before any other sample, in order.
    pub(super) fn replay(&self) -> Vec<SampleId> {
        self.rebuild
            .as_ref()
            .map_or_else(Vec::new, |r| r.saved.documents())
    }

    /// The next sequence, when one is ready.
    pub(super) fn next_sequence(&mut self) -> Option<Sample> {
        if self.rebuild.is_some() || self.failed || self.none_left() {
            return None;
        }
        let sequence = match self.packer.pop() {
            Some(sequence) => sequence,
            // The documents ended short of the plan (some were skipped):
            // padding keeps this rank's steps those of the others.
            None if self.ended && self.planned.is_some() => self.packer.padding(),
            None => return None,
        };
        if let Some(planned) = &mut self.planned {
            planned.left -= 1;
        }
        Some(sequence)
    }

    /// Whether the stream ends here: the sequences planned handed out, or
    /// every sequence handed out and no document to come, or a document
    /// failed.
    pub(super) fn is_done(&self) -> bool {
        self.failed
            || self.none_left()
            || (self.ended
                && self.rebuild.is_none()
                && self.packer.is_empty()
                && self.planned.is_none())
    }

    /// Takes the next document from the pipeline: one of those read again
    /// while the packer is rebuilt, then new ones. A document whose field is
    /// not token ids fails the stream (nothing more is packed from it).
    pub(super) fn take(&mut self, doc: Sample) -> Result<()> {
        let Some(rebuild) = &mut self.rebuild else {
            let count = self.packer.push(&doc).inspect_err(|_| self.failed = true)?;
            return self
                .check_count(&doc, count)
                .inspect_err(|_| self.failed = true);
        };
        rebuild.docs.insert(doc.id, doc);
        rebuild.left = rebuild.left.saturating_sub(1);
        if rebuild.left > 0 {
            return Ok(());
        }
        let Some(rebuild) = self.rebuild.take() else {
            return Ok(());
        };
        self.packer = empty_packer(&self.spec, self.ids_epoch)
            .restore(&rebuild.saved, &rebuild.docs)
            .inspect_err(|_| self.failed = true)?;
        Ok(())
    }

    /// Checks a document's `count` of tokens against the manifest's.
    fn check_count(&self, doc: &Sample, count: usize) -> Result<()> {
        let Some(planned) = &self.planned else {
            return Ok(());
        };
        let recorded = planned
            .counts
            .get(doc.id.shard)
            .and_then(Option::as_ref)
            .and_then(|tokens| tokens.counts.get(doc.id.index as usize));
        match recorded {
            Some(&recorded) if recorded == count as u64 => Ok(()),
            _ => Err(Error::ManifestMismatch {
                url: doc.url.to_string(),
                reason: format!(
                    "sample {} (key {:?}) holds {count} tokens of field {:?}, the manifest's \
                     token counts say {}: the shard or the tokenizer changed since it was \
                     indexed; run `shardstream index --count-tokens` again",
                    doc.id.index,
                    doc.key,
                    self.spec.field_name(),
                    recorded.map_or_else(|| "none".to_owned(), u64::to_string)
                ),
            }),
        }
    }

    /// The sequences the stage still hands out, when planned (across ranks).
    pub(super) fn sequences_left(&self) -> Option<u64> {
        self.planned.as_ref().map(|p| p.left)
    }

    /// The document stream failed: the stream ends here, without the
    /// sequences still open.
    pub(super) fn fail(&mut self) {
        self.failed = true;
    }

    /// The documents ended: the open sequences are handed out, padded.
    /// Returns the documents with no tokens that no sequence carries (the
    /// packer held nothing else), for the stream to report as left out;
    /// none across ranks, where the plan's proof accounts for them.
    pub(super) fn end(&mut self) -> Result<Vec<SampleId>> {
        self.ended = true;
        if let Some(rebuild) = &self.rebuild {
            self.failed = true;
            return Err(Error::StateMismatch(format!(
                "state field pack: {} of the documents it holds were not read again",
                rebuild.left
            )));
        }
        let carried_by_none = self.packer.finish();
        if self.planned.is_some() {
            return Ok(Vec::new());
        }
        Ok(carried_by_none)
    }

    /// What a state saves of the stage: the saved packer until it is
    /// rebuilt, then the packer's.
    pub(super) fn state(&self) -> PackState {
        if self.none_left() {
            return PackState::default();
        }
        match &self.rebuild {
            Some(rebuild) => rebuild.saved.clone(),
            None => self.packer.state(),
        }
    }

    /// Whether the stage holds nothing for a state to save.
    pub(super) fn holds_nothing(&self) -> bool {
        self.none_left() || (self.rebuild.is_none() && self.packer.is_empty())
    }
}

/// A packer by `spec`, giving ids of `ids_epoch` when given.
fn empty_packer(spec: &Arc<PackSpec>, ids_epoch: Option<u64>) -> Packer {
    let packer = Packer::new(spec.clone());
    match ids_epoch {
        Some(epoch) => packer.with_ids(epoch),
        None => packer,
    }
}
