//! Google Cloud Storage credentials, found as Google's client libraries
//! find Application Default Credentials: the JSON key file named by
//! `GOOGLE_APPLICATION_CREDENTIALS` (a service account's key, whose signed
//! JWT is exchanged for an access token at the key's `token_uri`, or a
//! gcloud user's refresh token), else the metadata server named by
//! `GCE_METADATA_HOST`, else gcloud's `application_default_credentials.json`,
//! else the metadata server of a Google Cloud machine (asked only when the
//! machine says it is a Google one), else none: public buckets are read
//! anonymously. With `STORAGE_EMULATOR_HOST` (an emulator's address) only
//! the explicit ones (the two variables) are used. Tokens are kept until five
//! minutes before they expire. No token or key appears in an error.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{RsaKeyPair, RSA_PKCS1_SHA256};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::PrivatePkcs8KeyDer;
use tokio::sync::Mutex;

use crate::store::http::{AuthorizationFuture, OriginCredentials};

/// The public endpoint of Google Cloud Storage.
const PUBLIC_ENDPOINT: &str = "https://storage.googleapis.com";

/// The scope tokens are asked for: reading objects.
const SCOPE: &str = "https://www.googleapis.com/auth/devstorage.read_only";

/// Where tokens are exchanged when a key file names no `token_uri`.
const DEFAULT_TOKEN_URI: &str = "https://oauth2.googleapis.com/token";

/// The metadata server of a Google Cloud machine.
const METADATA_HOST: &str = "169.254.169.254";

/// The most time one token request may take (the metadata server: less).
const TOKEN_TIMEOUT: Duration = Duration::from_secs(15);

/// The most time one request to the metadata server may take.
const METADATA_TIMEOUT: Duration = Duration::from_secs(3);

/// Attempts of one token request (transient failures are retried).
const TOKEN_ATTEMPTS: u32 = 3;

/// A token is renewed this long before it expires.
const REFRESH_MARGIN: Duration = Duration::from_secs(300);

/// The most bytes of a token answer.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// How an error for want of an access token begins.
pub const NO_TOKEN: &str = "no Google Cloud access token";

/// A non-empty environment variable.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// The endpoint of Google Cloud Storage: `STORAGE_EMULATOR_HOST`
/// (`host:port` or a URL) for an emulator, else storage.googleapis.com.
pub fn gcs_endpoint() -> String {
    endpoint_of(env("STORAGE_EMULATOR_HOST").as_deref())
}

/// The endpoint an emulator's address gives (`http://` when it names no scheme).
fn endpoint_of(emulator: Option<&str>) -> String {
    match emulator {
        Some(host) => {
            let host = host.trim().trim_end_matches('/');
            if host.contains("://") {
                host.to_owned()
            } else {
                format!("http://{host}")
            }
        }
        None => PUBLIC_ENDPOINT.to_owned(),
    }
}

/// Whether a request for `url` (at the GCS endpoint) may carry the access
/// token: not when it is a signed URL, which carries its own authorization
/// (GCS refuses a request with two).
fn takes_token(url: &url::Url) -> bool {
    !url.query_pairs().any(|(name, _)| {
        name.eq_ignore_ascii_case("x-goog-signature") || name.eq_ignore_ascii_case("signature")
    })
}

/// How access tokens are obtained.
enum Credentials {
    /// A service account's key: a signed JWT exchanged at `token_uri`.
    ServiceAccount {
        email: String,
        key: RsaKeyPair,
        token_uri: String,
    },
    /// A gcloud user's refresh token, exchanged at `token_uri`.
    AuthorizedUser { form: String, token_uri: String },
    /// The metadata server at `host`.
    Metadata { host: String },
    /// No credentials: requests go unauthenticated.
    Anonymous,
}

/// `text` percent-encoded but for RFC 3986's unreserved characters: a URL
/// path segment, a query value or an `application/x-www-form-urlencoded`
/// value.
pub(crate) fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A JSON key file of Application Default Credentials: a service
/// account's key (`type` `service_account`) or a gcloud user's refresh
/// token (`authorized_user`); the fields of the other type are absent.
/// (No `Debug`: it holds secrets.)
#[derive(serde::Deserialize)]
struct KeyFile {
    /// The kind of credentials.
    #[serde(rename = "type")]
    kind: Option<String>,
    /// Where tokens are exchanged ([`DEFAULT_TOKEN_URI`] when absent).
    token_uri: Option<String>,
    /// The service account's address.
    client_email: Option<String>,
    /// The service account's RSA key, PKCS#8 PEM.
    private_key: Option<String>,
    /// The OAuth2 client of a gcloud user.
    client_id: Option<String>,
    /// That client's secret.
    client_secret: Option<String>,
    /// The gcloud user's refresh token.
    refresh_token: Option<String>,
}

/// The credentials of a JSON key file (`what` names where it came from).
fn load_key_file(path: &Path, what: &str) -> Result<Credentials, String> {
    let named = format!("{what} ({})", path.display());
    let text = std::fs::read(path).map_err(|e| format!("cannot read {named}: {e}"))?;
    // serde's reason is not shown: it may quote a secret.
    let file: KeyFile = serde_json::from_slice(&text)
        .map_err(|_| format!("{named} is not a JSON credentials file"))?;
    let field = |value: &Option<String>, name: &str| -> Result<String, String> {
        value
            .clone()
            .filter(|v| !v.is_empty())
            .ok_or_else(|| format!("{named} has no {name:?}"))
    };
    let token_uri = file
        .token_uri
        .clone()
        .unwrap_or_else(|| DEFAULT_TOKEN_URI.to_owned());
    match file.kind.as_deref() {
        Some("service_account") => {
            let pem = field(&file.private_key, "private_key")?;
            let der = PrivatePkcs8KeyDer::from_pem_slice(pem.as_bytes())
                .map_err(|_| format!("the \"private_key\" of {named} is not a PKCS#8 PEM key"))?;
            let key = RsaKeyPair::from_pkcs8(der.secret_pkcs8_der())
                .map_err(|_| format!("the \"private_key\" of {named} is not an RSA key"))?;
            Ok(Credentials::ServiceAccount {
                email: field(&file.client_email, "client_email")?,
                key,
                token_uri,
            })
        }
        Some("authorized_user") => {
            let form = format!(
                "grant_type=refresh_token&client_id={}&client_secret={}&refresh_token={}",
                percent_encode(&field(&file.client_id, "client_id")?),
                percent_encode(&field(&file.client_secret, "client_secret")?),
                percent_encode(&field(&file.refresh_token, "refresh_token")?)
            );
            Ok(Credentials::AuthorizedUser { form, token_uri })
        }
        Some(other) => Err(format!(
            "{named} holds credentials of type {other:?}: only \"service_account\" and \
             \"authorized_user\" are supported"
        )),
        None => Err(format!("{named} has no \"type\"")),
    }
}

/// Whether this machine says it is a Google Cloud one.
fn on_google_cloud() -> bool {
    std::fs::read_to_string("/sys/class/dmi/id/product_name")
        .is_ok_and(|name| name.contains("Google"))
}

/// The Application Default Credentials of this process (see the module).
fn find_credentials() -> Result<Credentials, String> {
    if let Some(path) = env("GOOGLE_APPLICATION_CREDENTIALS") {
        return load_key_file(Path::new(&path), "GOOGLE_APPLICATION_CREDENTIALS");
    }
    if let Some(host) = env("GCE_METADATA_HOST") {
        return Ok(Credentials::Metadata {
            host: host.trim().to_owned(),
        });
    }
    if env("STORAGE_EMULATOR_HOST").is_some() {
        return Ok(Credentials::Anonymous);
    }
    let gcloud = env("CLOUDSDK_CONFIG")
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|home| Path::new(&home).join(".config/gcloud")));
    if let Some(file) = gcloud.map(|dir| dir.join("application_default_credentials.json")) {
        if file.is_file() {
            return load_key_file(&file, "gcloud's application default credentials");
        }
    }
    if on_google_cloud() {
        return Ok(Credentials::Metadata {
            host: METADATA_HOST.to_owned(),
        });
    }
    Ok(Credentials::Anonymous)
}

/// A signed JWT asking `token_uri` for a token of [`SCOPE`] (RS256).
fn signed_assertion(email: &str, key: &RsaKeyPair, token_uri: &str) -> Result<String, String> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"RS256","typ":"JWT"}"#);
    let claims = serde_json::json!({
        "iss": email, "scope": SCOPE, "aud": token_uri, "iat": now, "exp": now + 3600,
    });
    let message = format!("{header}.{}", URL_SAFE_NO_PAD.encode(claims.to_string()));
    let mut signature = vec![0; key.public_modulus_len()];
    key.sign(
        &RSA_PKCS1_SHA256,
        &SystemRandom::new(),
        message.as_bytes(),
        &mut signature,
    )
    .map_err(|_| "the service account's key cannot sign".to_owned())?;
    Ok(format!("{message}.{}", URL_SAFE_NO_PAD.encode(signature)))
}

/// A client for token requests (which need a body: hyper's plain client).
type TokenClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// A client over rustls with the system's roots (none: https fails to verify).
fn token_client() -> Result<TokenClient, String> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(METADATA_TIMEOUT));
    let tls = crate::store::tls::connector_builder()?;
    let https = tls.https_or_http().enable_http1().wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new()).build(https))
}

/// An access token and how long it lives.
struct Token {
    value: HeaderValue,
    lifetime: Duration,
}

/// The answer of a token endpoint or of the metadata server (RFC 6749 5.1).
/// (No `Debug`: it holds a secret.)
#[derive(serde::Deserialize)]
struct TokenAnswer {
    /// The access token.
    access_token: Option<String>,
    /// Its lifetime in seconds (an hour when absent).
    expires_in: Option<u64>,
}

/// The answer of a token endpoint that refuses (RFC 6749 5.2).
#[derive(serde::Deserialize)]
struct TokenRefusal {
    /// The OAuth2 error code (`invalid_grant` ...).
    error: Option<String>,
}

/// One token request; `Err(Ok(reason))` for a failure worth another attempt.
async fn request_token(
    client: &TokenClient,
    request: Request<Full<Bytes>>,
    timeout: Duration,
    what: &str,
) -> Result<Token, Result<String, String>> {
    let answer = async {
        let response = client
            .request(request)
            .await
            .map_err(|e| Ok(format!("{what}: connection failed: {e}")))?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| Ok(format!("{what}: the answer broke: {e}")))?
            .to_bytes();
        Ok::<_, Result<String, String>>((status, body))
    };
    let (status, body) = tokio::time::timeout(timeout, answer)
        .await
        .map_err(|_| Ok(format!("{what}: no answer within {timeout:?}")))??;
    if status != StatusCode::OK {
        // The OAuth2 error code ("invalid_grant" ...) tells why; nothing else is shown.
        let code = serde_json::from_slice::<TokenRefusal>(&body)
            .ok()
            .and_then(|refusal| refusal.error)
            .filter(|e| e.len() < 64 && e.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
            .map_or(String::new(), |e| format!(" ({e})"));
        let reason = format!("{what}: HTTP {}{code}", status.as_u16());
        let transient = status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS;
        return Err(if transient { Ok(reason) } else { Err(reason) });
    }
    // serde's reason is not shown: it may quote the token.
    let answer: TokenAnswer = serde_json::from_slice(&body).map_err(|e| {
        Err(if e.is_data() {
            format!("{what}: the answer is not an OAuth2 token answer")
        } else {
            format!("{what}: the answer is not JSON")
        })
    })?;
    let token = answer
        .access_token
        .filter(|t| !t.is_empty())
        .ok_or_else(|| Err(format!("{what}: the answer holds no access token")))?;
    let mut value = HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
        Err(format!(
            "{what}: the access token is not a valid header value"
        ))
    })?;
    value.set_sensitive(true);
    let seconds = answer.expires_in.unwrap_or(3600);
    Ok(Token {
        value,
        lifetime: Duration::from_secs(seconds),
    })
}

impl Credentials {
    /// A fresh access token (`None` when anonymous), retried on transient failures.
    async fn fetch(&self, client: &TokenClient) -> Result<Option<Token>, String> {
        let mut last = String::new();
        for attempt in 0..TOKEN_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(500 << attempt)).await;
            }
            let form = |uri: &str, body: String| {
                Request::builder()
                    .method(Method::POST)
                    .uri(uri)
                    .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                    .body(Full::new(Bytes::from(body)))
                    .map_err(|_| format!("the token URI {uri:?} is not valid"))
            };
            let (request, timeout, what) = match self {
                Credentials::Anonymous => return Ok(None),
                Credentials::ServiceAccount {
                    email,
                    key,
                    token_uri,
                } => {
                    let assertion = signed_assertion(email, key, token_uri)?;
                    let body = format!(
                        "grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer\
                         &assertion={assertion}"
                    );
                    let what = format!("the token endpoint {token_uri} (service account {email})");
                    (form(token_uri, body)?, TOKEN_TIMEOUT, what)
                }
                Credentials::AuthorizedUser {
                    form: body,
                    token_uri,
                } => {
                    let what = format!("the token endpoint {token_uri} (gcloud user credentials)");
                    (form(token_uri, body.clone())?, TOKEN_TIMEOUT, what)
                }
                Credentials::Metadata { host } => {
                    let uri = format!(
                        "http://{host}/computeMetadata/v1/instance/service-accounts/default/token\
                         ?scopes={}",
                        percent_encode(SCOPE)
                    );
                    let request = Request::builder()
                        .method(Method::GET)
                        .uri(&uri)
                        .header("Metadata-Flavor", "Google")
                        .body(Full::new(Bytes::new()))
                        .map_err(|_| format!("the metadata host {host:?} is not valid"))?;
                    (
                        request,
                        METADATA_TIMEOUT,
                        format!("the metadata server {host}"),
                    )
                }
            };
            match request_token(client, request, timeout, &what).await {
                Ok(token) => return Ok(Some(token)),
                Err(Ok(reason)) => last = reason,
                Err(Err(reason)) => return Err(reason),
            }
        }
        Err(format!("gave up after {TOKEN_ATTEMPTS} attempts: {last}"))
    }
}

/// What [`GoogleAuth`] has found so far.
#[derive(Default)]
struct AuthState {
    credentials: Option<Result<Credentials, String>>,
    client: Option<TokenClient>,
    /// The current token and when it is to be renewed.
    token: Option<(HeaderValue, Instant)>,
}

/// The `Authorization` header of requests to Google Cloud Storage: the
/// credentials are looked for at the first request, the token kept until
/// shortly before it expires and shared by all requests of a client.
#[derive(Default)]
struct GoogleAuth {
    state: Mutex<AuthState>,
}

/// Google Cloud Storage's credentials for the HTTP(S) client: an access
/// token for requests to its endpoint (not for signed URLs).
pub fn credentials() -> Option<Box<dyn OriginCredentials>> {
    let endpoint = url::Url::parse(&gcs_endpoint()).ok()?;
    Some(Box::new(GcsToken {
        endpoint,
        auth: GoogleAuth::default(),
    }))
}

/// The access token of requests to the GCS endpoint.
struct GcsToken {
    endpoint: url::Url,
    auth: GoogleAuth,
}

impl OriginCredentials for GcsToken {
    fn endpoint(&self) -> &url::Url {
        &self.endpoint
    }

    fn authorization<'a>(&'a self, url: &'a url::Url) -> AuthorizationFuture<'a> {
        Box::pin(async move {
            if !takes_token(url) {
                return Ok(None);
            }
            self.auth
                .bearer()
                .await
                .map_err(|reason| format!("{NO_TOKEN}: {reason}"))
        })
    }
}

impl GoogleAuth {
    /// The `Bearer` header value to send (`None`: anonymous), or why none
    /// can be had.
    async fn bearer(&self) -> Result<Option<HeaderValue>, String> {
        let mut state = self.state.lock().await;
        if let Some((value, renew_at)) = &state.token {
            if Instant::now() < *renew_at {
                return Ok(Some(value.clone()));
            }
        }
        let state = &mut *state;
        let credentials = match state.credentials.get_or_insert_with(find_credentials) {
            Ok(Credentials::Anonymous) => return Ok(None),
            Ok(credentials) => &*credentials,
            Err(reason) => return Err(reason.clone()),
        };
        if state.client.is_none() {
            state.client = Some(token_client()?);
        }
        let client = state
            .client
            .as_ref()
            .ok_or("no client for token requests")?;
        let Some(token) = credentials.fetch(client).await? else {
            return Ok(None);
        };
        let margin = REFRESH_MARGIN.min(token.lifetime / 2);
        state.token = Some((
            token.value.clone(),
            Instant::now() + token.lifetime - margin,
        ));
        Ok(Some(token.value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_emulator_host_becomes_an_endpoint_url() {
        assert_eq!(endpoint_of(None), "https://storage.googleapis.com");
        assert_eq!(endpoint_of(Some("localhost:9023")), "http://localhost:9023");
        assert_eq!(endpoint_of(Some("https://gcs.test/ ")), "https://gcs.test");
        assert_eq!(percent_encode("a b/c"), "a%20b%2Fc");
    }

    #[test]
    fn signed_urls_carry_no_token() {
        let url = |u: &str| url::Url::parse(u).unwrap();
        assert!(takes_token(&url(
            "https://storage.googleapis.com/download/storage/v1/b/b/o/k?alt=media"
        )));
        assert!(!takes_token(&url(
            "https://storage.googleapis.com/b/k?X-Goog-Signature=ab&X-Goog-Date=1"
        )));
        assert!(!takes_token(&url(
            "https://storage.googleapis.com/b/k?GoogleAccessId=a&Signature=ab"
        )));
    }

    #[test]
    fn key_files_are_refused_with_reasons_that_hold_no_secret() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key.json");
        for (text, words) in [
            ("not json", "not a JSON credentials file"),
            (r#"{"type": "external_account"}"#, "only"),
            (
                r#"{"type": "service_account", "client_email": "a@b", "private_key": "SECRETKEY"}"#,
                "not a PKCS#8 PEM key",
            ),
        ] {
            std::fs::write(&path, text).unwrap();
            let Err(reason) = load_key_file(&path, "GOOGLE_APPLICATION_CREDENTIALS") else {
                panic!("accepted {text}");
            };
            assert!(reason.contains(words), "{reason}");
            assert!(!reason.contains("SECRETKEY"), "{reason}");
        }
    }

    #[test]
    fn user_key_files_are_read_with_the_default_token_uri() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("application_default_credentials.json");
        std::fs::write(
            &path,
            r#"{"type": "authorized_user", "client_id": "id.apps", "client_secret": "s e",
                "refresh_token": "1//r", "quota_project_id": "p", "universe_domain": "x"}"#,
        )
        .unwrap();
        let Ok(Credentials::AuthorizedUser { form, token_uri }) = load_key_file(&path, "gcloud")
        else {
            panic!("not read as a user's credentials");
        };
        assert_eq!(token_uri, DEFAULT_TOKEN_URI);
        assert_eq!(
            form,
            "grant_type=refresh_token&client_id=id.apps&client_secret=s%20e&refresh_token=1%2F%2Fr"
        );
        std::fs::write(
            &path,
            r#"{"type": "authorized_user", "client_id": "id", "client_secret": "",
                "refresh_token": "r"}"#,
        )
        .unwrap();
        let Err(reason) = load_key_file(&path, "gcloud") else {
            panic!("accepted an empty client_secret");
        };
        assert!(reason.contains(r#"has no "client_secret""#), "{reason}");
    }

    #[test]
    fn token_answers_are_read_with_or_without_a_lifetime() {
        let answer: TokenAnswer = serde_json::from_str(
            r#"{"access_token": "ya29.a", "expires_in": 3599, "token_type": "Bearer"}"#,
        )
        .unwrap();
        assert_eq!(answer.access_token.as_deref(), Some("ya29.a"));
        assert_eq!(answer.expires_in, Some(3599));
        let answer: TokenAnswer = serde_json::from_str(r#"{"access_token": "ya29.b"}"#).unwrap();
        assert_eq!(answer.expires_in, None);
        let refusal: TokenRefusal = serde_json::from_str(
            r#"{"error": "invalid_grant", "error_description": "Invalid JWT Signature."}"#,
        )
        .unwrap();
        assert_eq!(refusal.error.as_deref(), Some("invalid_grant"));
        // Google APIs also answer with an error object: no code is read from it.
        assert!(serde_json::from_str::<TokenRefusal>(r#"{"error": {"code": 401}}"#).is_err());
    }
}
