//! Datasets on the Hugging Face Hub: `hf://datasets/ORG/NAME[@REVISION]/PATH`
//! (a file, a folder ending in `/`, or a glob such as `train/*.tar`) is
//! resolved once, in the process that builds the dataset, through the
//! Hub's HTTP API: the revision (default `main`) to the commit it points
//! at, then a listing of the repository's tree at that commit (every page,
//! with sizes). Each file becomes an `https://` shard at the Hub's
//! `resolve` endpoint pinned to that commit, read by the HTTP source (which
//! follows its redirect to the CDN and sends the token to the Hub only), so
//! a dataset is read as it was when it was resolved, whatever is pushed
//! since. `HF_ENDPOINT` and `HF_TOKEN` (or the token file) are honoured.

pub mod auth;

use std::collections::HashMap;

use super::http::{origin, with_http_client, HttpClient};
use crate::config::Transport;
use crate::error::{Error, Result};
use auth::hub_endpoint;

/// The most pages of one tree listing (a bound on a server that never
/// stops handing out a next page).
const MAX_PAGES: usize = 100_000;

/// The most bytes of one API answer.
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// What to do when the Hub refuses a request.
const TOKEN_HINT: &str = "the repository may not exist, or be private or gated: set HF_TOKEN \
     (or log in with `hf auth login`) to a token that may read it";

/// Whether `url` is a Hub URL (`hf://`).
pub fn is_hub_url(url: &str) -> bool {
    url.starts_with("hf://")
}

/// A Hub URL, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HubUrl {
    /// `ORG/NAME`.
    repo: String,
    /// Branch, tag or commit.
    revision: String,
    /// Path in the repository: a file, a folder (empty, or ending in `/`)
    /// or a glob.
    path: String,
}

/// Parses `hf://datasets/ORG/NAME[@REVISION]/PATH`; the reason if it is not one.
fn parse(url: &str) -> std::result::Result<HubUrl, String> {
    let form = "expected hf://datasets/ORG/NAME[@REVISION]/PATH";
    let rest = url.strip_prefix("hf://").ok_or(form)?;
    let Some(rest) = rest.strip_prefix("datasets/") else {
        return Err(format!(
            "only dataset repositories can be read ({form}; models and spaces are not supported)"
        ));
    };
    let mut parts = rest.splitn(3, '/');
    let org = parts.next().unwrap_or("");
    let name = parts.next().unwrap_or("");
    let path = parts.next().unwrap_or("");
    let (name, revision) = match name.split_once('@') {
        Some((name, revision)) => (name, revision.replace("%2F", "/").replace("%2f", "/")),
        None => (name, "main".to_owned()),
    };
    let valid = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    if !valid(org) || !valid(name) {
        return Err(format!(
            "{form} (ORG and NAME: letters, digits, '-', '_', '.')"
        ));
    }
    if revision.is_empty() {
        return Err(format!("{form} (an empty revision after '@')"));
    }
    if path.split('/').any(|c| c == "..") {
        return Err("a path in the repository may not hold '..'".into());
    }
    Ok(HubUrl {
        repo: format!("{org}/{name}"),
        revision,
        path: path.to_owned(),
    })
}

/// Checks the form of a Hub URL (nothing is fetched): the reason if it is not one.
pub fn check_url(url: &str) -> std::result::Result<(), String> {
    parse(url).map(|_| ())
}

/// Whether `path` has glob characters.
fn is_glob(path: &str) -> bool {
    path.contains(['*', '?', '['])
}

/// Whether `path` matches `pattern`: `*` any characters but `/`, `**`
/// any characters, `?` one character but `/`, `[abc]`, `[a-z]` and
/// `[!a-z]` one character of (or not of) a set.
fn glob_match(pattern: &[char], path: &[char]) -> bool {
    match pattern.first() {
        None => path.is_empty(),
        Some('*') if pattern.get(1) == Some(&'*') => {
            let rest = &pattern[2..];
            // `**/` matches no folder too (`a/**/b` takes `a/b`), as fsspec's
            // and git's globs do.
            (rest.first() == Some(&'/') && glob_match(&rest[1..], path))
                || (0..=path.len()).any(|i| glob_match(rest, &path[i..]))
        }
        Some('*') => {
            let rest = &pattern[1..];
            for i in 0..=path.len() {
                if glob_match(rest, &path[i..]) {
                    return true;
                }
                if path.get(i) == Some(&'/') {
                    return false;
                }
            }
            false
        }
        Some('?') => {
            path.first().is_some_and(|&c| c != '/') && glob_match(&pattern[1..], &path[1..])
        }
        Some('[') => match (pattern.iter().position(|&c| c == ']'), path.first()) {
            (Some(close), Some(&c)) if close > 1 && c != '/' => {
                let set = &pattern[1..close];
                let (negated, set) = match set.first() {
                    Some('!') => (true, &set[1..]),
                    _ => (false, set),
                };
                let mut found = false;
                let mut i = 0;
                while i < set.len() {
                    if i + 2 < set.len() && set[i + 1] == '-' {
                        found |= (set[i]..=set[i + 2]).contains(&c);
                        i += 3;
                    } else {
                        found |= set[i] == c;
                        i += 1;
                    }
                }
                found != negated && glob_match(&pattern[close + 1..], &path[1..])
            }
            _ => false,
        },
        Some(&literal) => path.first() == Some(&literal) && glob_match(&pattern[1..], &path[1..]),
    }
}

/// `text` percent-encoded for a URL path (`/` kept when `keep_slash`).
fn encode(text: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || (keep_slash && b == b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The target of the `next` link of a `Link` header, if any.
fn next_link(link: &str) -> Option<String> {
    link.split(',').find_map(|part| {
        let (target, params) = part.split_once(';')?;
        let is_next = params.split(';').any(|p| {
            let p = p.trim().replace(' ', "");
            p == "rel=\"next\"" || p == "rel=next"
        });
        is_next.then(|| {
            target
                .trim()
                .trim_start_matches('<')
                .trim_end_matches('>')
                .to_owned()
        })
    })
}

/// The page a listing's `next` link (on page `page`) points at, if it is
/// on the Hub's `endpoint` origin: the user's `http_headers` and the token
/// go there, so a page elsewhere is refused (an error naming `url`).
fn same_origin(url: &str, endpoint: &str, page: &str, link: &str, what: &str) -> Result<String> {
    let refused = |reason: String| Error::Read {
        url: url.to_owned(),
        offset: 0,
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{what}: {reason}")),
    };
    let base =
        url::Url::parse(page).map_err(|e| refused(format!("a page URL is not valid: {e}")))?;
    let next = base
        .join(link)
        .map_err(|_| refused("the Hub's next page link is not a valid URL".into()))?;
    let home = url::Url::parse(endpoint)
        .map_err(|e| refused(format!("the endpoint {endpoint:?} is not a valid URL: {e}")))?;
    if origin(&next) != origin(&home) {
        let (scheme, host, port) = origin(&next);
        let port = port.map_or(String::new(), |p| format!(":{p}"));
        return Err(refused(format!(
            "the Hub's answer links its next page to {scheme}://{host}{port}, another origin \
             than the endpoint {}; not followed (request headers go to the endpoint only)",
            home.origin().ascii_serialization()
        )));
    }
    Ok(next.into())
}

/// An error of an API request, told about the Hub URL `url` the user gave.
fn about(url: &str, error: Error, what: &str) -> Error {
    match error {
        Error::NotFound { source, .. } => Error::NotFound {
            url: url.to_owned(),
            source: std::io::Error::new(source.kind(), format!("{what}: {source}")),
        },
        Error::AccessDenied { source, .. } => Error::AccessDenied {
            url: url.to_owned(),
            source: std::io::Error::new(source.kind(), format!("{what}: {source}; {TOKEN_HINT}")),
        },
        Error::Read { source, .. } => Error::Read {
            url: url.to_owned(),
            offset: 0,
            source: std::io::Error::new(source.kind(), format!("{what}: {source}")),
        },
        other => other,
    }
}

/// The answer of `GET /api/datasets/REPO/revision/REV`: the dataset's
/// information at that revision, of which only the commit is read.
#[derive(serde::Deserialize)]
struct RevisionInfo {
    /// The commit the revision points at.
    #[serde(deserialize_with = "commit_id")]
    sha: String,
}

/// A commit id: a non-empty string of ASCII letters and digits.
fn commit_id<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<String, D::Error> {
    let text = <String as serde::Deserialize>::deserialize(deserializer)?;
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(serde::de::Error::invalid_value(
            serde::de::Unexpected::Str(&text),
            &"a commit id (letters and digits)",
        ));
    }
    Ok(text)
}

/// An entry of a tree listing (`GET /api/datasets/REPO/tree/COMMIT/FOLDER`).
#[derive(serde::Deserialize)]
struct TreeEntry {
    /// Path in the repository.
    path: Option<String>,
    /// `file` or `directory`.
    #[serde(rename = "type")]
    kind: Option<String>,
    /// Size in bytes (none for a folder).
    size: Option<u64>,
}

/// A JSON answer of the API as a `T` (and its `next` page link); JSON of
/// another shape is an error naming `hub_url` that `shape` describes.
async fn get_json<T: serde::de::DeserializeOwned>(
    client: &HttpClient,
    hub_url: &str,
    api: &str,
    what: &str,
    shape: &str,
) -> Result<(T, Option<String>)> {
    let (headers, body) = client
        .get_small(api, MAX_ANSWER_BYTES)
        .await
        .map_err(|e| about(hub_url, e, what))?;
    let answer = serde_json::from_slice(&body).map_err(|e| Error::Read {
        url: hub_url.to_owned(),
        offset: 0,
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            if e.is_data() {
                format!("{what}: {shape}: {e}")
            } else {
                format!("{what}: the Hub's answer is not JSON: {e}")
            },
        ),
    })?;
    let next = headers
        .get_all(http::header::LINK)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(next_link);
    Ok((answer, next))
}

/// Resolves Hub URLs, remembering each revision's commit and each listing,
/// so that the URLs of one brace pattern cost one listing.
pub struct Resolver<'a> {
    transport: &'a Transport,
    endpoint: String,
    commits: HashMap<(String, String), String>,
    /// Files (path, size) under a folder of a commit, listed recursively.
    trees: HashMap<Listing, Vec<(String, u64)>>,
}

/// A listing: repository, commit, folder, and whether it is recursive.
type Listing = (String, String, String, bool);

/// A file listed by the Hub: (path, size, is a folder).
type Entry = (String, u64, bool);

impl<'a> Resolver<'a> {
    /// A resolver with the timeouts and retries of `transport`.
    pub fn new(transport: &'a Transport) -> Self {
        Resolver {
            transport,
            endpoint: hub_endpoint(),
            commits: HashMap::new(),
            trees: HashMap::new(),
        }
    }

    /// The files `url` names, sorted by path, as `(https URL pinned to the
    /// commit, size)`. A folder or a glob gives the files `keep` takes; a
    /// file must exist. Nothing found is an error naming `url`.
    pub fn resolve(&mut self, url: &str, keep: fn(&str) -> bool) -> Result<Vec<(String, u64)>> {
        let hub = parse(url).map_err(|reason| Error::Spec {
            spec: url.to_owned(),
            reason,
        })?;
        let transport = self.transport;
        with_http_client(
            transport,
            auth::credentials().into_iter().collect(),
            async |client| {
                let commit = self.commit(client, url, &hub).await?;
                let path = hub.path.as_str();
                let mut files: Vec<(String, u64)> = if is_glob(path) {
                    let fixed = &path[..path.find(['*', '?', '[']).unwrap_or(0)];
                    let folder = &fixed[..fixed.rfind('/').map_or(0, |i| i + 1)];
                    let pattern: Vec<char> = path.chars().collect();
                    let listed = self.list(client, url, &hub, &commit, folder, true).await?;
                    // A file whose own name it is (`a[1].tar`) is that file.
                    match listed.iter().find(|(p, _, dir)| !dir && p == path) {
                        Some((p, size, _)) => vec![(p.clone(), *size)],
                        None => listed
                            .into_iter()
                            .filter(|(p, _, dir)| {
                                !dir && keep(p)
                                    && glob_match(&pattern, &p.chars().collect::<Vec<_>>())
                            })
                            .map(|(p, size, _)| (p, size))
                            .collect(),
                    }
                } else if path.is_empty() || path.ends_with('/') {
                    self.folder(client, url, &hub, &commit, path, keep).await?
                } else {
                    let parent = &path[..path.rfind('/').map_or(0, |i| i + 1)];
                    let listed = self.list(client, url, &hub, &commit, parent, false).await?;
                    match listed.into_iter().find(|(p, _, _)| p == path) {
                        Some((_, _, true)) => {
                            self.folder(client, url, &hub, &commit, &format!("{path}/"), keep)
                                .await?
                        }
                        Some((p, size, false)) => vec![(p, size)],
                        None => {
                            return Err(Error::NotFound {
                                url: url.to_owned(),
                                source: std::io::Error::new(
                                    std::io::ErrorKind::NotFound,
                                    format!("no file {path:?} in {} at commit {commit}", hub.repo),
                                ),
                            })
                        }
                    }
                };
                if files.is_empty() {
                    return Err(Error::Spec {
                        spec: url.to_owned(),
                        reason: format!(
                            "no file of {} at commit {commit} matches {path:?}",
                            hub.repo
                        ),
                    });
                }
                files.sort();
                let base = format!(
                    "{}/datasets/{}/resolve/{commit}",
                    self.endpoint,
                    encode(&hub.repo, true)
                );
                Ok(files
                    .into_iter()
                    .map(|(p, size)| (format!("{base}/{}", encode(&p, true)), size))
                    .collect())
            },
        )
    }

    /// The files under `folder` (recursively) that `keep` takes.
    async fn folder(
        &mut self,
        client: &HttpClient,
        url: &str,
        hub: &HubUrl,
        commit: &str,
        folder: &str,
        keep: fn(&str) -> bool,
    ) -> Result<Vec<(String, u64)>> {
        Ok(self
            .list(client, url, hub, commit, folder, true)
            .await?
            .into_iter()
            .filter(|(p, _, dir)| !dir && keep(p))
            .map(|(p, size, _)| (p, size))
            .collect())
    }

    /// The commit a revision points at (`GET /api/datasets/REPO/revision/REV`).
    async fn commit(&mut self, client: &HttpClient, url: &str, hub: &HubUrl) -> Result<String> {
        let key = (hub.repo.clone(), hub.revision.clone());
        if let Some(commit) = self.commits.get(&key) {
            return Ok(commit.clone());
        }
        let api = format!(
            "{}/api/datasets/{}/revision/{}",
            self.endpoint,
            encode(&hub.repo, true),
            encode(&hub.revision, false)
        );
        let what = format!("revision {:?} of {}", hub.revision, hub.repo);
        let no_commit = "the Hub's answer gives no commit (\"sha\")";
        let (info, _): (RevisionInfo, _) = get_json(client, url, &api, &what, no_commit).await?;
        let commit = info.sha;
        self.commits.insert(key, commit.clone());
        Ok(commit)
    }

    /// The entries under `folder` at `commit` (every page of
    /// `GET /api/datasets/REPO/tree/COMMIT/FOLDER`).
    async fn list(
        &mut self,
        client: &HttpClient,
        url: &str,
        hub: &HubUrl,
        commit: &str,
        folder: &str,
        recursive: bool,
    ) -> Result<Vec<Entry>> {
        let folder = folder.trim_end_matches('/');
        let key = (
            hub.repo.clone(),
            commit.to_owned(),
            folder.to_owned(),
            recursive,
        );
        if let Some(files) = self.trees.get(&key) {
            return Ok(files.iter().map(|(p, s)| (p.clone(), *s, false)).collect());
        }
        let mut next = Some(format!(
            "{}/api/datasets/{}/tree/{commit}/{}?recursive={recursive}&expand=false",
            self.endpoint,
            encode(&hub.repo, true),
            encode(folder, true)
        ));
        let what = format!("listing {folder:?} of {} at commit {commit}", hub.repo);
        let mut entries = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let failed = |reason: String| Error::Read {
            url: url.to_owned(),
            offset: 0,
            source: std::io::Error::other(format!("{what}: {reason}")),
        };
        for _ in 0..MAX_PAGES {
            let Some(page) = next.take() else { break };
            if !seen.insert(page.clone()) {
                return Err(failed(format!("the next page {page} was read already")));
            }
            let not_a_list = "the Hub's answer is not a list of files and folders";
            let (items, link): (Vec<TreeEntry>, _) =
                get_json(client, url, &page, &what, not_a_list).await?;
            for item in items {
                let (Some(path), Some(kind)) = (item.path, item.kind) else {
                    return Err(failed("an entry of the answer has no path or type".into()));
                };
                let directory = kind == "directory";
                let size = match item.size {
                    Some(size) => size,
                    None if directory => 0,
                    None => return Err(failed(format!("the answer gives no size for {path:?}"))),
                };
                entries.push((path, size, directory));
            }
            next = match link {
                Some(link) => Some(same_origin(url, &self.endpoint, &page, &link, &what)?),
                None => None,
            };
        }
        if next.is_some() {
            return Err(failed(format!("more than {MAX_PAGES} pages")));
        }
        let files = entries
            .iter()
            .filter(|(_, _, dir)| !dir)
            .map(|(p, s, _)| (p.clone(), *s))
            .collect();
        if recursive {
            self.trees.insert(key, files);
        }
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(pattern: &str, path: &str) -> bool {
        let chars = |s: &str| s.chars().collect::<Vec<_>>();
        glob_match(&chars(pattern), &chars(path))
    }

    #[test]
    fn hub_urls_are_parsed_with_their_revision() {
        assert_eq!(
            parse("hf://datasets/org/name@v1.0/train/*.tar").unwrap(),
            HubUrl {
                repo: "org/name".into(),
                revision: "v1.0".into(),
                path: "train/*.tar".into()
            }
        );
        let main = parse("hf://datasets/org/name").unwrap();
        assert_eq!((main.revision.as_str(), main.path.as_str()), ("main", ""));
        let refs = parse("hf://datasets/o/n@refs%2Fconvert%2Fparquet/x").unwrap();
        assert_eq!(refs.revision, "refs/convert/parquet");
        for bad in [
            "hf://models/org/name/x.tar",
            "hf://datasets/org",
            "hf://datasets/org/na me/x",
            "hf://datasets/org/name@/x",
            "hf://datasets/org/name/../x",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn globs_match_within_folders_unless_doubled() {
        assert!(matches("train/*.tar", "train/shard-0.tar"));
        assert!(!matches("train/*.tar", "train/sub/shard-0.tar"));
        assert!(matches("train/**.tar", "train/sub/shard-0.tar"));
        // `**/` takes no folder too.
        assert!(matches("train/**/*.tar", "train/shard-0.tar"));
        assert!(matches("train/**/*.tar", "train/a/b/shard-0.tar"));
        assert!(matches("**/*.tar", "shard-0.tar"));
        assert!(!matches("train/**/*.tar", "trainx.tar"));
        assert!(matches("train/shard-?.tar", "train/shard-7.tar"));
        assert!(matches("train/shard-[0-4].tar", "train/shard-3.tar"));
        assert!(!matches("train/shard-[!0-4].tar", "train/shard-3.tar"));
        assert!(!matches("train/*.tar", "train/a.tar.gz"));
    }

    #[test]
    fn next_links_are_found() {
        let link = "<https://h/api/datasets/o/n/tree/x?cursor=abc>; rel=\"next\"";
        assert_eq!(
            next_link(link).as_deref(),
            Some("https://h/api/datasets/o/n/tree/x?cursor=abc")
        );
        assert_eq!(next_link("<https://h/p>; rel=\"prev\""), None);
    }

    #[test]
    fn next_pages_are_followed_on_the_endpoint_only() {
        let page = "https://hub.example/api/datasets/o/n/tree/c?recursive=true";
        let next = |link| {
            same_origin(
                "hf://datasets/o/n/x",
                "https://hub.example",
                page,
                link,
                "listing",
            )
        };
        assert_eq!(
            next("https://HUB.example:443/api/p?cursor=2").unwrap(),
            "https://hub.example/api/p?cursor=2"
        );
        assert_eq!(
            next("/api/p?cursor=3").unwrap(),
            "https://hub.example/api/p?cursor=3"
        );
        for elsewhere in [
            "https://other.example/api/p",
            "http://hub.example/api/p",
            "https://hub.example:8443/p",
        ] {
            let error = next(elsewhere).unwrap_err().to_string();
            assert!(
                error.contains("another origin") && error.contains("hf://datasets/o/n/x"),
                "{error}"
            );
        }
    }

    #[test]
    fn revision_answers_give_their_commit() {
        let info: RevisionInfo = serde_json::from_str(
            r#"{"_id": "x", "id": "org/name", "sha": "0123abcd", "private": false,
                "siblings": [{"rfilename": "train/a.tar"}], "cardData": null}"#,
        )
        .unwrap();
        assert_eq!(info.sha, "0123abcd");
        for bad in [
            r#"{"id": "org/name"}"#,
            r#"{"sha": null}"#,
            r#"{"sha": ""}"#,
            r#"{"sha": "../main"}"#,
            r#"{"sha": 12}"#,
        ] {
            let Err(error) = serde_json::from_str::<RevisionInfo>(bad) else {
                panic!("accepted {bad}");
            };
            assert!(error.is_data(), "{bad}: {error}");
        }
    }

    #[test]
    fn tree_entries_are_read_with_or_without_a_size() {
        let entries: Vec<TreeEntry> = serde_json::from_str(
            r#"[{"type": "directory", "oid": "aa", "path": "train"},
                {"type": "file", "oid": "bb", "size": 10240, "path": "train/a.tar",
                 "lfs": {"oid": "cc", "size": 10240, "pointerSize": 132}, "xetHash": "dd"},
                {"oid": "ee", "size": 1}]"#,
        )
        .unwrap();
        let read: Vec<_> = entries
            .iter()
            .map(|e| (e.path.as_deref(), e.kind.as_deref(), e.size))
            .collect();
        assert_eq!(
            read,
            [
                (Some("train"), Some("directory"), None),
                (Some("train/a.tar"), Some("file"), Some(10240)),
                (None, None, Some(1)),
            ]
        );
        for bad in [r#"{"path": "a"}"#, r#"[{"path": "a", "size": "12"}]"#] {
            let Err(error) = serde_json::from_str::<Vec<TreeEntry>>(bad) else {
                panic!("accepted {bad}");
            };
            assert!(error.is_data(), "{bad}: {error}");
        }
    }

    #[test]
    fn paths_are_percent_encoded() {
        assert_eq!(encode("a b/c#d.tar", true), "a%20b/c%23d.tar");
        assert_eq!(encode("refs/pr/1", false), "refs%2Fpr%2F1");
    }
}
