//! The size of a held item in bytes, which bounded buffers (the shuffle
//! buffer, the output queue) count against their byte budgets.

/// Something with a size in bytes, for a buffer's byte budget.
pub trait ByteSize {
    /// Bytes this item counts against the budget.
    fn byte_size(&self) -> usize;
}
