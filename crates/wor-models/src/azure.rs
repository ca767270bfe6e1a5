//! The Azure OpenAI provider: chat completions at a deployment,
//! `POST {base_url}/openai/deployments/{deployment}/chat/completions?api-version={version}`.
//!
//! The wire format is OpenAI's (the request and answer code is [`crate::openai`]'s); what
//! differs is the URL, which names the deployment (the routine's model id) and the API version,
//! and the key, sent in an `api-key` header instead of `Authorization: Bearer`. The base URL is
//! the resource's endpoint, `https://NAME.openai.azure.com`; an `?api-version=…` on it chooses
//! the version, else [`DEFAULT_API_VERSION`] is used. Streams may carry chunks with no choices
//! (content-filter results on the prompt); they are skipped like any chunk without choice 0.

use secrecy::ExposeSecret;
use wor_core::model::{ModelRequest, ModelResponse, ProviderKind};
use wor_egress::EgressClient;
use wor_egress::header::HeaderName;

use crate::error::ModelError;
use crate::openai::{exchange, request_body};
use crate::transport::{ProviderEndpoint, ProviderOptions, secret_header};
use crate::{ModelFuture, ModelProvider, StreamSink};

/// The generally available data-plane API version used when the base URL names none.
pub const DEFAULT_API_VERSION: &str = "2024-10-21";

/// A client of one Azure OpenAI resource.
#[derive(Debug)]
pub struct AzureOpenAiProvider {
    egress: EgressClient,
    endpoint: ProviderEndpoint,
    options: ProviderOptions,
}

impl AzureOpenAiProvider {
    /// A provider sending through `egress` to the resource at `endpoint`.
    pub fn new(egress: EgressClient, endpoint: ProviderEndpoint, options: ProviderOptions) -> Self {
        Self {
            egress,
            endpoint,
            options,
        }
    }

    async fn complete_turn(
        &self,
        request: &ModelRequest,
        sink: &mut dyn StreamSink,
    ) -> Result<ModelResponse, ModelError> {
        let url = deployment_url(&self.endpoint.base_url, &request.model)?;
        let mut body = request_body(request, self.options.streaming);
        // The deployment in the URL chooses the model.
        if let Some(object) = body.as_object_mut() {
            object.remove("model");
        }
        let auth = match &self.endpoint.api_key {
            Some(key) => Some((
                HeaderName::from_static("api-key"),
                secret_header(key.expose_secret())?,
            )),
            None => None,
        };
        exchange(
            &self.egress,
            &self.endpoint,
            &self.options,
            &url,
            body,
            auth,
            sink,
        )
        .await
    }
}

impl ModelProvider for AzureOpenAiProvider {
    fn kind(&self) -> ProviderKind {
        ProviderKind::AzureOpenai
    }

    fn complete<'a>(
        &'a self,
        request: &'a ModelRequest,
        sink: &'a mut dyn StreamSink,
    ) -> ModelFuture<'a> {
        Box::pin(self.complete_turn(request, sink))
    }
}

/// The chat-completions URL of `deployment` at the resource `base_url` (which may end in
/// `/openai` and may carry `?api-version=…`).
pub fn deployment_url(base_url: &str, deployment: &str) -> Result<String, ModelError> {
    let safe = |text: &str| {
        !text.is_empty()
            && text
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    if !safe(deployment) {
        return Err(ModelError::InvalidRequest(
            "an azure deployment name is letters, digits, `-`, `_` and `.`".to_owned(),
        ));
    }
    let (base, query) = base_url.split_once('?').unwrap_or((base_url, ""));
    let version = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("api-version="))
        .unwrap_or(DEFAULT_API_VERSION);
    if !wor_core::model::is_azure_api_version(version) {
        return Err(ModelError::InvalidRequest(
            "the azure `api-version` is a date (`YYYY-MM-DD`, optionally `-preview`), `preview` or `latest`".to_owned(),
        ));
    }
    let base = base.trim_end_matches('/');
    let base = base.strip_suffix("/openai").unwrap_or(base);
    Ok(format!(
        "{base}/openai/deployments/{deployment}/chat/completions?api-version={version}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deployment_urls_name_the_deployment_and_version() {
        assert_eq!(
            deployment_url("https://r.openai.azure.com/", "gpt-4o-mini").unwrap(),
            "https://r.openai.azure.com/openai/deployments/gpt-4o-mini/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(
            deployment_url(
                "https://r.openai.azure.com/openai?api-version=2025-01-01-preview",
                "prod"
            )
            .unwrap(),
            "https://r.openai.azure.com/openai/deployments/prod/chat/completions?api-version=2025-01-01-preview"
        );
        for bad in ["", "a/b", "../x", "a?b", "a b"] {
            assert!(deployment_url("https://r", bad).is_err(), "{bad}");
        }
        assert!(deployment_url("https://r?api-version=2024-10-21&x", "d").is_ok());
        for version in ["1", "1/2", "2024-10-21/x", "0123456789abcdef"] {
            let url = format!("https://r?api-version={version}");
            assert!(deployment_url(&url, "d").is_err(), "{version}");
        }
    }
}
