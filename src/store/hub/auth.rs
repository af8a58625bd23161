//! Who the Hugging Face Hub is and what proves the user to it: its
//! endpoint and the token huggingface_hub would send, which the HTTP(S)
//! client (`store/http/`) is given to send to that endpoint only.

use http::HeaderValue;

use crate::store::http::{AuthorizationFuture, OriginCredentials};

/// The Hub's token, as the `Bearer` header of requests to its endpoint.
struct HubToken {
    endpoint: url::Url,
    header: HeaderValue,
}

impl OriginCredentials for HubToken {
    fn endpoint(&self) -> &url::Url {
        &self.endpoint
    }

    fn authorization<'a>(&'a self, _url: &'a url::Url) -> AuthorizationFuture<'a> {
        Box::pin(async move { Ok(Some(self.header.clone())) })
    }
}

/// The Hub's credentials for the HTTP(S) client: its token, when one is
/// found, for its endpoint.
pub fn credentials() -> Option<Box<dyn OriginCredentials>> {
    let token = hub_token()?;
    let endpoint = url::Url::parse(&hub_endpoint()).ok()?;
    let mut header = HeaderValue::from_str(&format!("Bearer {token}")).ok()?;
    header.set_sensitive(true);
    Some(Box::new(HubToken { endpoint, header }))
}

/// The Hugging Face Hub's endpoint: `HF_ENDPOINT`, else huggingface.co.
pub fn hub_endpoint() -> String {
    std::env::var("HF_ENDPOINT")
        .ok()
        .filter(|e| !e.trim().is_empty())
        .map_or_else(
            || "https://huggingface.co".to_owned(),
            |e| e.trim().trim_end_matches('/').to_owned(),
        )
}

/// The Hugging Face token, as huggingface_hub finds it: `HF_TOKEN`, else
/// the file at `HF_TOKEN_PATH`, else `$HF_HOME/token` (`HF_HOME` defaulting
/// to `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`).
fn hub_token() -> Option<String> {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if let Some(token) = env("HF_TOKEN") {
        return Some(token.trim().to_owned());
    }
    let path = env("HF_TOKEN_PATH")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            let home = env("HF_HOME").map(std::path::PathBuf::from).or_else(|| {
                let cache = env("XDG_CACHE_HOME")
                    .map(std::path::PathBuf::from)
                    .or_else(|| env("HOME").map(|h| std::path::Path::new(&h).join(".cache")))?;
                Some(cache.join("huggingface"))
            })?;
            Some(home.join("token"))
        })?;
    let token = std::fs::read_to_string(path).ok()?;
    let token = token.trim();
    (!token.is_empty()).then(|| token.to_owned())
}
