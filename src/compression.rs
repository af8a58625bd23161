//! How a shard's bytes are compressed: the vocabulary that manifests,
//! errors and the decoders share.

use std::fmt;

use serde::{Deserialize, Serialize};

/// How a shard's bytes are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// gzip (RFC 1952), one member or several concatenated.
    Gzip,
    /// Zstandard, one frame or several concatenated.
    Zstd,
}

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

impl Compression {
    /// The compression whose magic bytes start `head`, if any: a zstd
    /// stream may start with a skippable frame (magic `0x184D2A50` to
    /// `0x184D2A5F`, little-endian), as every file `pzstd` writes does.
    pub fn detect(head: &[u8]) -> Option<Self> {
        let skippable = matches!(head, [first, 0x2a, 0x4d, 0x18, ..] if first & 0xf0 == 0x50);
        if head.starts_with(&GZIP_MAGIC) {
            Some(Compression::Gzip)
        } else if head.starts_with(&ZSTD_MAGIC) || skippable {
            Some(Compression::Zstd)
        } else {
            None
        }
    }

    /// The name used in manifests and messages: `gzip` or `zstd`.
    pub fn name(self) -> &'static str {
        match self {
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
