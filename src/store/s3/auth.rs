//! S3 credentials: why none could be loaded (where they were looked for),
//! which error codes mean the store rejects them, and how a user provides
//! them, said in sentences.

use super::super::ranged::{cause_chain, error_chain, MAX_CHAIN};

/// What to do about credentials: how a user provides them.
pub(super) const CREDENTIALS_HINT: &str =
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, name a profile \
     of the shared config files (AWS_PROFILE, or S3Config(profile=...)), or read a public \
     bucket with unsigned requests (S3Config(unsigned=True))";

/// Error codes by which a store rejects the credentials themselves (not
/// the rights they carry), with what each means.
pub(super) const REJECTED_CREDENTIALS: [(&str, &str); 5] = [
    (
        "InvalidAccessKeyId",
        "the store knows no such access key id",
    ),
    (
        "SignatureDoesNotMatch",
        "the secret access key does not match the access key id",
    ),
    ("ExpiredToken", "the session token has expired"),
    ("TokenRefreshRequired", "the session token has expired"),
    ("InvalidToken", "the session token is not valid"),
];

/// Why no credentials could be used, when `error` (or one of its sources)
/// is a failure to load them, as a sentence that says where they were
/// looked for and how to provide them.
pub(super) fn credentials_problem(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    use aws_config::meta::ProviderChainError;
    use aws_credential_types::provider::error::CredentialsError;
    use std::error::Error as _;
    let mut next = Some(error);
    for _ in 0..MAX_CHAIN {
        let current = next?;
        if let Some(credentials) = current.downcast_ref::<CredentialsError>() {
            let tried = credentials
                .source()
                .and_then(|s| s.downcast_ref::<ProviderChainError<CredentialsError>>());
            let reason = match (credentials, tried) {
                (CredentialsError::CredentialsNotLoaded(_), Some(chain)) => {
                    let attempts = chain
                        .attempts()
                        .iter()
                        .map(|a| {
                            format!("{}: {}", source_name(a.name()), attempt_outcome(a.error()))
                        })
                        .collect::<Vec<_>>();
                    format!("none were found (tried {})", attempts.join("; "))
                }
                (CredentialsError::CredentialsNotLoaded(_), None) => {
                    format!("none were found ({})", cause_chain(credentials))
                }
                (CredentialsError::ProviderTimedOut(_), _) => {
                    format!("loading them timed out ({})", error_chain(credentials))
                }
                _ => format!("loading them failed: {}", cause_chain(credentials)),
            };
            return Some(format!("{reason}; {CREDENTIALS_HINT}"));
        }
        let text = current.to_string();
        if text.starts_with("identity resolver timed out") {
            return Some(format!(
                "loading them timed out ({text}); {CREDENTIALS_HINT}"
            ));
        }
        next = current.source();
    }
    None
}

/// Why one source of the credential chain gave none.
fn attempt_outcome(error: &aws_credential_types::provider::error::CredentialsError) -> String {
    use aws_credential_types::provider::error::CredentialsError;
    use std::error::Error as _;
    match (error, error.source()) {
        // Its own message ("the credential provider was not enabled") says nothing more.
        (CredentialsError::CredentialsNotLoaded(_), None) => "none there".into(),
        _ => cause_chain(error),
    }
}

/// A readable name of a provider of the default credential chain.
fn source_name(provider: &str) -> &str {
    match provider {
        "Environment" => "environment variables",
        "Profile" => "shared config and credentials files",
        "WebIdentityToken" => "web identity token",
        "EcsContainer" => "ECS container endpoint",
        "Ec2InstanceMetadata" => "EC2 instance metadata (IMDS)",
        other => other,
    }
}
