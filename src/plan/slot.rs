//! Where a stream sits in the job: its rank and DataLoader worker.

use crate::error::{Error, Result};

/// The most processes a job may have (2^20): far above any job run today,
/// and low enough that a typo (`10**11`) is an error, not an allocation.
pub const MAX_WORLD_SIZE: usize = 1 << 20;

/// The most slots (`world_size * num_workers`) a job may have (2^24): a
/// plan of the whole job (the CLI's, an elastic resume's check of every
/// saved slot) holds a list per slot.
pub const MAX_SLOTS: usize = 1 << 24;

/// Where a stream sits in the job: its rank and DataLoader worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotSpec {
    /// Number of processes in the job.
    pub world_size: usize,
    /// This process's rank.
    pub rank: usize,
    /// DataLoader workers per process (1 when iterating in the main process).
    pub num_workers: usize,
    /// This worker's id.
    pub worker_id: usize,
}

impl SlotSpec {
    /// Validates the four numbers.
    pub fn new(
        world_size: usize,
        rank: usize,
        num_workers: usize,
        worker_id: usize,
    ) -> Result<Self> {
        let check = |name: &'static str, ok: bool, reason: String| {
            if ok {
                Ok(())
            } else {
                Err(Error::Config { name, reason })
            }
        };
        check(
            "world_size",
            world_size >= 1,
            format!("must be at least 1, got {world_size}"),
        )?;
        check(
            "world_size",
            world_size <= MAX_WORLD_SIZE,
            format!("must be at most {MAX_WORLD_SIZE}, got {world_size}"),
        )?;
        check(
            "rank",
            rank < world_size,
            format!("must be below world_size {world_size}, got {rank}"),
        )?;
        check(
            "num_workers",
            num_workers >= 1,
            format!("must be at least 1, got {num_workers}"),
        )?;
        check(
            "num_workers",
            world_size
                .checked_mul(num_workers)
                .is_some_and(|slots| slots <= MAX_SLOTS),
            format!(
                "world_size x num_workers must be at most {MAX_SLOTS} slots, got {world_size} x {num_workers}"
            ),
        )?;
        check(
            "worker_id",
            worker_id < num_workers,
            format!("must be below num_workers {num_workers}, got {worker_id}"),
        )?;
        Ok(SlotSpec {
            world_size,
            rank,
            num_workers,
            worker_id,
        })
    }

    /// Total number of slots in the job.
    pub fn slot_count(&self) -> usize {
        self.world_size * self.num_workers
    }

    /// This slot's index: `rank * num_workers + worker_id`.
    pub fn slot(&self) -> usize {
        self.rank * self.num_workers + self.worker_id
    }
}
