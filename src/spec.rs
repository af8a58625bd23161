//! Dataset spec, as text: brace ranges, URL schemes, the names a listing
//! takes and the dataset formats. Parsing only: resolution (the `resolve`
//! module, which does the I/O) turns specs into shards.

use crate::error::{Error, Result};

/// Name suffixes of the shard files a directory or prefix spec lists.
pub const SHARD_SUFFIXES: [&str; 4] = [".tar", ".tar.gz", ".tgz", ".tar.zst"];

/// Whether a directory or prefix listing takes the file or object `name`
/// as a shard (by its suffix, in any case: `SHARD-0.TAR` too; compression
/// itself is told by the bytes).
pub fn is_shard_name(name: &str) -> bool {
    SHARD_SUFFIXES.iter().any(|suffix| has_suffix(name, suffix))
}

/// Whether `name` ends in `suffix`, ASCII letters in any case (names made
/// on case-insensitive file systems: `.TAR`, `.Parquet`).
fn has_suffix(name: &str, suffix: &str) -> bool {
    let (name, suffix) = (name.as_bytes(), suffix.as_bytes());
    name.len() >= suffix.len() && name[name.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
}

/// Name suffixes of JSON-lines shards (one sample per line; compression
/// is told by the bytes).
pub const LINES_SUFFIXES: [&str; 3] = [".jsonl", ".jsonl.gz", ".jsonl.zst"];

/// Whether `name` is a JSON-lines shard's.
pub fn is_lines_name(name: &str) -> bool {
    LINES_SUFFIXES.iter().any(|suffix| has_suffix(name, suffix))
}

/// Whether `name` is a Parquet file's (`.parquet`, in any case).
pub fn is_parquet_name(name: &str) -> bool {
    has_suffix(name, ".parquet")
}

/// Whether `name` is a raw object's: anything but folder markers and
/// hidden files.
pub fn is_raw_name(name: &str) -> bool {
    let base = name.rsplit('/').next().unwrap_or(name);
    !base.is_empty() && !base.starts_with('.')
}

fn is_tar_or_parquet_name(name: &str) -> bool {
    is_shard_name(name) || is_parquet_name(name)
}

/// What the shards of a dataset hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DatasetFormat {
    /// Parquet for `*.parquet` names, JSON lines for `*.jsonl` (`.gz`,
    /// `.zst`) names, tar (plain, gzip or zstd) otherwise. A directory or
    /// prefix lists tar and Parquet names only, so that a `.jsonl` file
    /// beside tar shards (labels, metadata) is never read as one.
    #[default]
    Auto,
    /// WebDataset tar shards.
    Tar,
    /// Parquet files: one shard per row group, one sample per row.
    Parquet,
    /// Raw objects: one sample per file or object.
    Raw,
    /// JSON-lines shards: one sample per line, a JSON object whose keys
    /// are the sample's fields.
    Jsonl,
}

impl std::str::FromStr for DatasetFormat {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        use DatasetFormat::*;
        [Auto, Tar, Parquet, Raw, Jsonl]
            .into_iter()
            .find(|format| format.name() == s)
            .ok_or_else(|| Error::Config {
                name: "format",
                reason: format!(
                    "expected \"auto\", \"tar\", \"parquet\", \"raw\" or \"jsonl\", got {s:?}"
                ),
            })
    }
}

impl DatasetFormat {
    /// The format's name, as the `format` option takes it.
    pub fn name(self) -> &'static str {
        match self {
            DatasetFormat::Auto => "auto",
            DatasetFormat::Tar => "tar",
            DatasetFormat::Parquet => "parquet",
            DatasetFormat::Raw => "raw",
            DatasetFormat::Jsonl => "jsonl",
        }
    }

    /// Which names a directory or prefix listing takes.
    pub fn listing_filter(self) -> fn(&str) -> bool {
        match self {
            DatasetFormat::Auto => is_tar_or_parquet_name,
            DatasetFormat::Tar => is_shard_name,
            DatasetFormat::Parquet => is_parquet_name,
            DatasetFormat::Raw => is_raw_name,
            DatasetFormat::Jsonl => is_lines_name,
        }
    }
}

/// The most URLs one spec may expand to: a typo such as
/// `{0..99999999999}` is an error at once, not an allocation that ends in
/// the OOM killer.
pub const MAX_EXPANSION: u64 = 1_000_000;

/// Expands brace patterns: `{000..127}` (zero-padded to the width of the
/// bounds) and `{a,b,c}`; several groups give their product, left to right.
/// A brace preceded by a backslash (`\{`, `\}`) is the brace itself, not a
/// pattern, so any name is a spec of itself with a backslash put before
/// each of its braces. A spec that would expand to more than
/// [`MAX_EXPANSION`] URLs is an error.
pub fn expand_braces(spec: &str) -> Result<Vec<String>> {
    let count = expansion_count(spec)?;
    if count > MAX_EXPANSION {
        return Err(Error::Spec {
            spec: spec.to_owned(),
            reason: format!(
                "expands to {count} URLs, more than the {MAX_EXPANSION} a spec may name \
                 (a typo in a brace range?)"
            ),
        });
    }
    expand_checked(spec)
}

/// How many URLs `spec` expands to (saturating), checking its syntax.
fn expansion_count(spec: &str) -> Result<u64> {
    let mut count: u64 = 1;
    let mut rest = spec;
    while let Some((head, body, tail)) = next_group(spec, rest)? {
        let _ = head;
        let n = if let Some((lo, hi)) = body.split_once("..") {
            let (a, b, _) = range_bounds(lo, hi).ok_or_else(|| Error::Spec {
                spec: spec.to_owned(),
                reason: format!("bad range {{{body}}}"),
            })?;
            (b - a).saturating_add(1)
        } else {
            body.split(',').count() as u64
        };
        count = count.saturating_mul(n);
        rest = tail;
    }
    Ok(count)
}

/// `text` with the backslash of each escaped brace taken away.
fn unescape_braces(text: &str) -> String {
    text.replace("\\{", "{").replace("\\}", "}")
}

/// Where the first brace `brace` of `text` that no backslash escapes is.
fn find_unescaped(text: &str, brace: char) -> Option<usize> {
    text.match_indices(brace)
        .map(|(i, _)| i)
        .find(|&i| !text[..i].ends_with('\\'))
}

/// The first brace group of `rest` (a suffix of `spec`): the text before
/// it, its body and the text after it (escaped braces left as they are);
/// `None` when there is none.
fn next_group<'a>(spec: &str, rest: &'a str) -> Result<Option<(&'a str, &'a str, &'a str)>> {
    let bad = |reason: &str| Error::Spec {
        spec: spec.to_owned(),
        reason: reason.to_owned(),
    };
    let Some(open) = find_unescaped(rest, '{') else {
        if find_unescaped(rest, '}').is_some() {
            return Err(bad("'}' without '{' (write \\} for a brace in a name)"));
        }
        return Ok(None);
    };
    let close = find_unescaped(&rest[open..], '}')
        .map(|i| open + i)
        .ok_or_else(|| bad("'{' without '}' (write \\{ for a brace in a name)"))?;
    let (head, body, tail) = (&rest[..open], &rest[open + 1..close], &rest[close + 1..]);
    if find_unescaped(head, '}').is_some() {
        return Err(bad("'}' without '{' (write \\} for a brace in a name)"));
    }
    if find_unescaped(body, '{').is_some() {
        return Err(bad("nested braces are not supported"));
    }
    if !body.contains("..") && !body.contains(',') {
        return Err(bad(&format!("braces need a range or a list: {{{body}}}")));
    }
    Ok(Some((head, body, tail)))
}

/// Expands `spec`, whose size [`expansion_count`] has checked.
fn expand_checked(spec: &str) -> Result<Vec<String>> {
    let Some((head, body, tail)) = next_group(spec, spec)? else {
        return Ok(vec![unescape_braces(spec)]);
    };
    let head = unescape_braces(head);
    let alternatives = if let Some((lo, hi)) = body.split_once("..") {
        numeric_range(lo, hi).ok_or_else(|| Error::Spec {
            spec: spec.to_owned(),
            reason: format!("bad range {{{body}}}"),
        })?
    } else {
        body.split(',').map(unescape_braces).collect()
    };
    let tails = expand_checked(tail).map_err(|e| match e {
        Error::Spec { reason, .. } => Error::Spec {
            spec: spec.to_owned(),
            reason,
        },
        other => other,
    })?;
    let mut out = Vec::with_capacity(alternatives.len() * tails.len());
    for alternative in &alternatives {
        for t in &tails {
            out.push(format!("{head}{alternative}{t}"));
        }
    }
    Ok(out)
}

/// The bounds of a numeric range `lo..hi` and the width to pad to.
fn range_bounds(lo: &str, hi: &str) -> Option<(u64, u64, usize)> {
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(lo) || !all_digits(hi) {
        return None;
    }
    let (a, b): (u64, u64) = (lo.parse().ok()?, hi.parse().ok()?);
    if a > b {
        return None;
    }
    let padded = (lo.len() > 1 && lo.starts_with('0')) || (hi.len() > 1 && hi.starts_with('0'));
    let width = if padded { lo.len().max(hi.len()) } else { 0 };
    Some((a, b, width))
}

fn numeric_range(lo: &str, hi: &str) -> Option<Vec<String>> {
    let (a, b, width) = range_bounds(lo, hi)?;
    Some((a..=b).map(|n| format!("{n:0width$}")).collect())
}

/// The URL schemes a spec may use; anything else is refused at once.
pub const SUPPORTED_SCHEMES: &str = "local paths, file://, s3://, gs:// (Google Cloud \
     Storage), http://, https:// and hf://datasets/ (the Hugging Face Hub)";

/// Refuses a URL whose scheme shardstream cannot read (`az://`, `ftp://`,
/// webdataset's `pipe:` ...), naming it and the supported ones, and an
/// `http(s)://` URL naming a folder (HTTP has no listing). The form of an
/// `hf://` URL is checked when it is resolved.
pub fn check_scheme(url: &str) -> Result<()> {
    let scheme = match url.split_once("://") {
        Some((scheme, _))
            if !scheme.is_empty()
                && scheme
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"+.-".contains(&b)) =>
        {
            Some(scheme)
        }
        _ if url.starts_with("pipe:") => Some("pipe"),
        _ => None,
    };
    match scheme {
        None | Some("file") | Some("s3") | Some("hf") | Some("gs") => Ok(()),
        Some(http) if http.eq_ignore_ascii_case("http") || http.eq_ignore_ascii_case("https") => {
            let folder = url::Url::parse(url).is_ok_and(|parsed| parsed.path().ends_with('/'));
            if folder {
                return Err(Error::Spec {
                    spec: url.to_owned(),
                    reason: "an http(s):// URL ending in '/' names a folder, and HTTP has no \
                             listing: name the shards (a brace range such as \
                             shard-{000000..000099}.tar, or a list) or give a manifest; \
                             folders and prefixes are listed for s3://, gs:// and hf://"
                        .into(),
                });
            }
            Ok(())
        }
        Some(other) => Err(Error::Spec {
            spec: url.to_owned(),
            reason: format!(
                "the scheme {other:?} is not supported (supported: {SUPPORTED_SCHEMES})"
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_taken_by_their_suffix_in_any_case() {
        for name in ["a.tar", "A.TAR", "b.Tar.Gz", "c.TGZ", "d.tar.ZST", "é.tar"] {
            assert!(is_shard_name(name), "{name}");
        }
        for name in ["a.tar.bak", "tar", "a.TA", "é", "a.targz", ""] {
            assert!(!is_shard_name(name), "{name}");
        }
        assert!(is_parquet_name("t.PARQUET") && !is_parquet_name("t.parquet.tmp"));
        assert!(is_lines_name("l.JSONL.GZ") && !is_lines_name("l.json"));
    }

    #[test]
    fn expands_zero_padded_range() {
        let got = expand_braces("d/shard-{000008..000011}.tar").unwrap();
        assert_eq!(
            got,
            [
                "d/shard-000008.tar",
                "d/shard-000009.tar",
                "d/shard-000010.tar",
                "d/shard-000011.tar"
            ]
        );
    }

    #[test]
    fn expands_several_groups_left_to_right() {
        let got = expand_braces("{a,b}/{1..2}.tar").unwrap();
        assert_eq!(got, ["a/1.tar", "a/2.tar", "b/1.tar", "b/2.tar"]);
    }

    #[test]
    fn unpadded_range_has_no_padding() {
        assert_eq!(expand_braces("{9..10}").unwrap(), ["9", "10"]);
    }

    #[test]
    fn rejects_bad_patterns() {
        for bad in ["{1..", "x}", "{5..1}", "{a..b}", "{x}", "{{1..2}}"] {
            assert!(
                matches!(expand_braces(bad), Err(Error::Spec { .. })),
                "{bad} accepted"
            );
        }
    }

    #[test]
    fn escaped_braces_are_the_braces_themselves() {
        let escape = |name: &str| name.replace('{', "\\{").replace('}', "\\}");
        assert_eq!(expand_braces(r"d/b\{1,2\}.tar").unwrap(), ["d/b{1,2}.tar"]);
        assert_eq!(
            expand_braces(r"d/\{x\}-{1..2}.tar").unwrap(),
            ["d/{x}-1.tar", "d/{x}-2.tar"]
        );
        assert_eq!(expand_braces(r"{a\},b}.tar").unwrap(), ["a}.tar", "b.tar"]);
        for name in [
            "b{1,2}.tar",
            "c{0..1}.tar",
            "}{",
            r"a\{b",
            r"x\",
            r"\}",
            "plain.tar",
            r"back\slash.tar",
        ] {
            assert_eq!(expand_braces(&escape(name)).unwrap(), [name], "{name}");
        }
        assert!(
            expand_braces(r"a\{1,2}").is_err(),
            "an unescaped '}}' alone"
        );
    }

    #[test]
    fn huge_expansions_are_refused_before_allocating() {
        for spec in [
            "shard-{0..99999999999}.tar",
            "shard-{0..18446744073709551615}.tar",
            "{0..999}/{0..999}/{0..9}.tar",
        ] {
            let error = expand_braces(spec).unwrap_err().to_string();
            assert!(error.contains("more than the 1000000"), "{error}");
        }
        assert!(matches!(
            expand_braces("{0..18446744073709551616}"),
            Err(Error::Spec { .. })
        ));
        assert_eq!(
            expand_braces("{0..999}/{0..999}.tar").unwrap().len(),
            1_000_000
        );
    }
}
