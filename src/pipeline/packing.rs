//! The packing stage of a slot's stream (the `pack` option): the documents
//! the pipeline hands out go through a [`Packer`], and the stream hands out
//! its sequences. A resumed stream first receives, read again, the
//! documents the saved packer held (the pipeline sends them before any
//! other sample, outside the mirror: they were handed out before the save),
//! and rebuilds the packer from them.

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::{Sample, SampleId};
use crate::text::pack::{PackSpec, PackState, Packer};

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
}

impl PackStage {
    /// A stage packing by `spec` (with the documents' ids of `ids_epoch`,
    /// when given: `sample_ids`), rebuilding `saved` first when given.
    pub(super) fn new(
        spec: Arc<PackSpec>,
        saved: Option<PackState>,
        ids_epoch: Option<u64>,
    ) -> Self {
        let rebuild = saved.filter(|s| !s.is_empty()).map(|saved| Rebuild {
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
        }
    }

    /// The documents to read again before any other sample, in order.
    pub(super) fn replay(&self) -> Vec<SampleId> {
        self.rebuild
            .as_ref()
            .map_or_else(Vec::new, |r| r.saved.documents())
    }

    /// The next sequence, when one is ready.
    pub(super) fn next_sequence(&mut self) -> Option<Sample> {
        if self.rebuild.is_some() || self.failed {
            return None;
        }
        self.packer.pop()
    }

    /// Whether the stream ends here: every sequence handed out and no
    /// document to come, or a document failed.
    pub(super) fn is_done(&self) -> bool {
        self.failed || (self.ended && self.rebuild.is_none() && self.packer.is_empty())
    }

    /// Takes the next document from the pipeline: one of those read again
    /// while the packer is rebuilt, then new ones. A document whose field is
    /// not token ids fails the stream (nothing more is packed from it).
    pub(super) fn take(&mut self, doc: Sample) -> Result<()> {
        let Some(rebuild) = &mut self.rebuild else {
            return self.packer.push(&doc).inspect_err(|_| self.failed = true);
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

    /// The document stream failed: the stream ends here, without the
    /// sequences still open.
    pub(super) fn fail(&mut self) {
        self.failed = true;
    }

    /// The documents ended: the open sequences are handed out, padded.
    pub(super) fn end(&mut self) -> Result<()> {
        self.ended = true;
        if let Some(rebuild) = &self.rebuild {
            self.failed = true;
            return Err(Error::StateMismatch(format!(
                "state field pack: {} of the documents it holds were not read again",
                rebuild.left
            )));
        }
        self.packer.finish();
        Ok(())
    }

    /// What a state saves of the stage: the saved packer until it is
    /// rebuilt, then the packer's.
    pub(super) fn state(&self) -> PackState {
        match &self.rebuild {
            Some(rebuild) => rebuild.saved.clone(),
            None => self.packer.state(),
        }
    }

    /// Whether the stage holds nothing for a state to save.
    pub(super) fn holds_nothing(&self) -> bool {
        self.rebuild.is_none() && self.packer.is_empty()
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
