//! Augmentation: decoded fields turned into tensors of one fixed shape,
//! on the decode threads, deterministically from each sample's random
//! stream.

pub mod audio;
