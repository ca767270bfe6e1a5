//! HTTP API tools: a method and a path template on a connection's base URL.
//!
//! Executing fills the template from the arguments, one whole value per `{name}`, each
//! percent-encoded; a value holding `/` or `\`, or equal to `.` or `..`, is refused rather
//! than encoded, so an argument can never leave its path segment. The remaining arguments go
//! in the query string (`GET`, `HEAD`, `DELETE`) or a JSON body (other methods). The request
//! leaves through the [`EgressClient`] with the connection's allowlist, and the connection's
//! credential headers are attached at that moment.

use std::fmt;
use std::time::Duration;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use reqwest::header::{CONTENT_TYPE, HeaderValue};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use wor_egress::{EgressClient, EgressError, EgressRequest, EgressUrl, HostAllowlist, Method};

use crate::credentials::ConnectionCredentials;
use crate::definition::ToolDefinition;
use crate::result::{ToolCallResult, ToolContent};

/// The most tools one `http_api` connection holds, written or imported.
pub const MAX_HTTP_TOOLS: usize = 256;

/// Everything but RFC 3986 unreserved characters is encoded in a path value or query part.
const COMPONENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// An HTTP tool could not be defined or run.
#[derive(Debug, thiserror::Error)]
pub enum HttpToolError {
    /// The path template is malformed.
    #[error("path template `{template}` is invalid: {reason}")]
    InvalidTemplate {
        /// The template.
        template: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// A placeholder has no property in the input schema.
    #[error("path parameter `{0}` is not a property of the input schema")]
    UndeclaredPathParameter(String),
    /// The method is not one an HTTP tool may use.
    #[error("method `{0}` is not supported for http tools")]
    UnsupportedMethod(String),
    /// The connection's base URL is refused.
    #[error("base url is invalid: {0}")]
    InvalidBaseUrl(String),
    /// The base URL's host is not on the connection's allowlist.
    #[error("the base url's host is not on the connection's allowlist")]
    BaseUrlNotAllowlisted,
    /// A path argument is missing.
    #[error("missing path argument `{0}`")]
    MissingPathArgument(String),
    /// A path argument would leave its segment.
    #[error("path argument `{0}` may not contain `/` or `\\`, be empty, or be `.` or `..`")]
    PathInjection(String),
    /// A path or query argument is not a string, number or boolean.
    #[error("argument `{0}` must be a string, number or boolean")]
    NotScalar(String),
    /// The filled URL left the base URL's path (defence in depth; should not happen).
    #[error("the request url left the connection's base path")]
    LeftBasePath,
    /// The request could not be sent or was refused by the egress guard.
    #[error(transparent)]
    Egress(#[from] EgressError),
}

/// One piece of a path template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum TemplatePart {
    Literal(String),
    Parameter(String),
}

/// A path such as `/repos/{owner}/{repo}/issues`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathTemplate {
    source: String,
    parts: Vec<TemplatePart>,
}

impl fmt::Display for PathTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

impl PathTemplate {
    /// Parses a template: starts with `/`; no `?`, `#`, `..` segment or `%`; placeholders are
    /// `{name}` with `name` made of ASCII letters, digits and `_`.
    pub fn parse(template: &str) -> Result<Self, HttpToolError> {
        let invalid = |reason| HttpToolError::InvalidTemplate {
            template: template.to_owned(),
            reason,
        };
        if !template.starts_with('/') {
            return Err(invalid("it must start with `/`"));
        }
        if template.contains(['?', '#', '%', '\\']) || template.chars().any(char::is_whitespace) {
            return Err(invalid(
                "it may not contain `?`, `#`, `%`, `\\` or white space",
            ));
        }
        if template.split('/').any(|s| s == "." || s == "..") {
            return Err(invalid("it may not contain `.` or `..` segments"));
        }
        let mut parts = Vec::new();
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            let (literal, after) = rest.split_at(open);
            if literal.contains('}') {
                return Err(invalid("unbalanced `}`"));
            }
            let after = after.get(1..).unwrap_or_default();
            let close = after.find('}').ok_or_else(|| invalid("unclosed `{`"))?;
            let (name, tail) = after.split_at(close);
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(invalid(
                    "placeholder names are ascii letters, digits and `_`",
                ));
            }
            if !literal.is_empty() {
                parts.push(TemplatePart::Literal(literal.to_owned()));
            }
            parts.push(TemplatePart::Parameter(name.to_owned()));
            rest = tail.get(1..).unwrap_or_default();
        }
        if rest.contains('}') {
            return Err(invalid("unbalanced `}`"));
        }
        if !rest.is_empty() {
            parts.push(TemplatePart::Literal(rest.to_owned()));
        }
        Ok(Self {
            source: template.to_owned(),
            parts,
        })
    }

    /// The placeholder names, in order.
    pub fn parameters(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|part| match part {
            TemplatePart::Parameter(name) => Some(name.as_str()),
            TemplatePart::Literal(_) => None,
        })
    }

    /// The path with every placeholder filled from `arguments`.
    pub fn fill(&self, arguments: &Map<String, Value>) -> Result<String, HttpToolError> {
        let mut path = String::new();
        for part in &self.parts {
            match part {
                TemplatePart::Literal(literal) => path.push_str(literal),
                TemplatePart::Parameter(name) => {
                    let value = arguments
                        .get(name)
                        .ok_or_else(|| HttpToolError::MissingPathArgument(name.clone()))?;
                    let text =
                        scalar_text(value).ok_or_else(|| HttpToolError::NotScalar(name.clone()))?;
                    if text.is_empty() || text == "." || text == ".." || text.contains(['/', '\\'])
                    {
                        return Err(HttpToolError::PathInjection(name.clone()));
                    }
                    path.extend(utf8_percent_encode(&text, COMPONENT));
                }
            }
        }
        Ok(path)
    }
}

fn scalar_text(value: &Value) -> Option<String> {
    match value {
        Value::String(text) => Some(text.clone()),
        Value::Number(number) => Some(number.to_string()),
        Value::Bool(flag) => Some(flag.to_string()),
        _ => None,
    }
}

/// Whether `name` may name a tool (and a connection): 1 to 40 of `a-z`, `0-9`, `-` and `_`,
/// starting with a letter, as rosters name tools `CONNECTION/TOOL`.
pub fn is_valid_tool_name(name: &str) -> bool {
    (1..=40).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
}

/// An HTTP API connection: where its tools send requests, and with what credentials.
#[derive(Debug, Clone)]
pub struct HttpApiConnection {
    base_url: String,
    base_path: String,
    allowlist: HostAllowlist,
    credentials: ConnectionCredentials,
    /// Total timeout of one call.
    pub timeout: Duration,
    /// Largest response body accepted.
    pub max_response_bytes: u64,
}

impl HttpApiConnection {
    /// A connection to `base_url` (`https://api.example.com/v3`), whose host must be on
    /// `allowlist`.
    pub fn new(
        base_url: &str,
        allowlist: HostAllowlist,
        credentials: ConnectionCredentials,
    ) -> Result<Self, HttpToolError> {
        let parsed = EgressUrl::parse(base_url)
            .map_err(|refusal| HttpToolError::InvalidBaseUrl(refusal.to_string()))?;
        let url = parsed.as_url();
        if url.query().is_some() || url.fragment().is_some() {
            return Err(HttpToolError::InvalidBaseUrl(
                "it may not have a query or fragment".to_owned(),
            ));
        }
        if !allowlist.allows(parsed.host(), parsed.port()) {
            return Err(HttpToolError::BaseUrlNotAllowlisted);
        }
        let base_path = url.path().trim_end_matches('/').to_owned();
        let mut origin = url.clone();
        origin.set_path("");
        let base_url = format!("{}{base_path}", origin.as_str().trim_end_matches('/'));
        Ok(Self {
            base_url,
            base_path,
            allowlist,
            credentials,
            timeout: Duration::from_secs(30),
            max_response_bytes: 4 * 1024 * 1024,
        })
    }

    /// The connection's credentials (for its redactor).
    pub fn credentials(&self) -> &ConnectionCredentials {
        &self.credentials
    }
}

/// An HTTP tool: name, description, method, path template and the input schema of all its
/// arguments (path parameters included).
#[derive(Debug, Clone, PartialEq)]
pub struct HttpToolDefinition {
    name: String,
    description: Option<String>,
    method: Method,
    path: PathTemplate,
    input_schema: Map<String, Value>,
}

/// How an HTTP tool is written in a connection's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpToolConfig {
    /// The tool's name.
    pub name: String,
    /// What it does.
    #[serde(default)]
    pub description: Option<String>,
    /// `GET`, `POST`, `PUT`, `PATCH`, `DELETE` or `HEAD`.
    pub method: String,
    /// `/repos/{owner}/issues`.
    pub path: String,
    /// JSON Schema of all arguments.
    pub input_schema: Map<String, Value>,
}

impl HttpToolDefinition {
    /// Checks `config`: a supported method, a valid template, every placeholder a property.
    pub fn new(config: HttpToolConfig) -> Result<Self, HttpToolError> {
        let method = match config.method.to_ascii_uppercase().as_str() {
            "GET" => Method::GET,
            "POST" => Method::POST,
            "PUT" => Method::PUT,
            "PATCH" => Method::PATCH,
            "DELETE" => Method::DELETE,
            "HEAD" => Method::HEAD,
            _ => return Err(HttpToolError::UnsupportedMethod(config.method)),
        };
        let path = PathTemplate::parse(&config.path)?;
        let properties = config
            .input_schema
            .get("properties")
            .and_then(Value::as_object);
        for parameter in path.parameters() {
            if !properties.is_some_and(|p| p.contains_key(parameter)) {
                return Err(HttpToolError::UndeclaredPathParameter(parameter.to_owned()));
            }
        }
        Ok(Self {
            name: config.name,
            description: config.description,
            method,
            path,
            input_schema: config.input_schema,
        })
    }

    /// The definition to pin. Its annotations carry `{"http": {"method", "path"}}`, so the
    /// pinned hash also covers where the tool sends its requests.
    pub fn tool_definition(&self) -> ToolDefinition {
        let mut http = Map::new();
        http.insert("method".to_owned(), Value::String(self.method.to_string()));
        http.insert("path".to_owned(), Value::String(self.path.to_string()));
        let mut annotations = Map::new();
        annotations.insert("http".to_owned(), Value::Object(http));
        ToolDefinition {
            name: self.name.clone(),
            description: self.description.clone(),
            input_schema: self.input_schema.clone(),
            annotations: Some(Value::Object(annotations)),
        }
    }

    /// The method.
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The path template.
    pub fn path(&self) -> &PathTemplate {
        &self.path
    }

    fn sends_body(&self) -> bool {
        !matches!(self.method, Method::GET | Method::HEAD | Method::DELETE)
    }

    /// The URL and body for `arguments` (already prepared and validated).
    pub fn build_request(
        &self,
        connection: &HttpApiConnection,
        arguments: &Map<String, Value>,
    ) -> Result<(String, Option<Vec<u8>>), HttpToolError> {
        let path = self.path.fill(arguments)?;
        let parameters: Vec<&str> = self.path.parameters().collect();
        // Sorted by name, whatever order the map keeps: the same call builds the same request.
        let rest: std::collections::BTreeMap<String, Value> = arguments
            .iter()
            .filter(|(key, _)| !parameters.contains(&key.as_str()))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect();
        let mut url = format!("{}{path}", connection.base_url);
        let mut body = None;
        if self.sends_body() {
            body = Some(
                wor_core::canonical::to_canonical_json(&Value::Object(rest.into_iter().collect()))
                    .into_bytes(),
            );
        } else if !rest.is_empty() {
            let mut pairs = Vec::new();
            for (key, value) in &rest {
                let values: Vec<&Value> = match value {
                    Value::Array(items) => items.iter().collect(),
                    Value::Null => Vec::new(),
                    single => vec![single],
                };
                for value in values {
                    let text =
                        scalar_text(value).ok_or_else(|| HttpToolError::NotScalar(key.clone()))?;
                    pairs.push(format!(
                        "{}={}",
                        utf8_percent_encode(key, COMPONENT),
                        utf8_percent_encode(&text, COMPONENT)
                    ));
                }
            }
            if !pairs.is_empty() {
                url.push('?');
                url.push_str(&pairs.join("&"));
            }
        }
        let parsed = EgressUrl::parse(&url)
            .map_err(|refusal| HttpToolError::InvalidBaseUrl(refusal.to_string()))?;
        let filled_path = parsed.as_url().path();
        if !filled_path.starts_with(&format!("{}/", connection.base_path)) {
            return Err(HttpToolError::LeftBasePath);
        }
        Ok((url, body))
    }

    /// Sends the call through `egress` and turns the response into a [`ToolCallResult`]: a
    /// non-2xx status is a tool error (the model sees it), a refused or failed exchange is an
    /// [`HttpToolError`].
    pub async fn execute(
        &self,
        egress: &EgressClient,
        connection: &HttpApiConnection,
        arguments: &Map<String, Value>,
    ) -> Result<ToolCallResult, HttpToolError> {
        let (url, body) = self.build_request(connection, arguments)?;
        let mut request =
            EgressRequest::new(self.method.clone(), &url).with_allowlist(&connection.allowlist);
        request.timeout = Some(connection.timeout);
        request.max_response_bytes = Some(connection.max_response_bytes);
        if let Some(body) = body {
            request
                .headers
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            request.body = Some(body);
        }
        // Attached last, at send time: nothing the arguments fill can override them.
        for (name, value) in &connection.credentials.header_map() {
            request.headers.insert(name.clone(), value.clone());
        }
        let response = egress.send(request).await?;
        let is_json = response
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.split(';')
                    .next()
                    .is_some_and(|m| m.trim().ends_with("json"))
            });
        let mut content = Vec::new();
        let is_error = !response.status.is_success();
        if is_error {
            content.push(ToolContent::Text(format!(
                "http status {}",
                response.status.as_u16()
            )));
        }
        if !response.body.is_empty() {
            let json = is_json
                .then(|| serde_json::from_slice::<Value>(&response.body).ok())
                .flatten();
            content.push(match json {
                Some(value) => ToolContent::Json(value),
                None => ToolContent::Text(String::from_utf8_lossy(&response.body).into_owned()),
            });
        }
        Ok(ToolCallResult { content, is_error })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap()
    }

    fn connection() -> HttpApiConnection {
        HttpApiConnection::new(
            "https://api.example.com/v3/",
            HostAllowlist::parse(["api.example.com"]).unwrap(),
            ConnectionCredentials::none(),
        )
        .unwrap()
    }

    fn tool(method: &str, path: &str) -> HttpToolDefinition {
        HttpToolDefinition::new(HttpToolConfig {
            name: "t".into(),
            description: None,
            method: method.into(),
            path: path.into(),
            input_schema: args(json!({"type": "object", "properties": {
                "owner": {"type": "string"}, "repo": {"type": "string"}, "title": {"type": "string"}
            }})),
        })
        .unwrap()
    }

    #[test]
    fn fills_and_encodes_segments() {
        let template = PathTemplate::parse("/repos/{owner}/{repo}/issues").unwrap();
        assert_eq!(template.parameters().collect::<Vec<_>>(), ["owner", "repo"]);
        assert_eq!(
            template
                .fill(&args(json!({"owner": "a b?#%", "repo": 7})))
                .unwrap(),
            "/repos/a%20b%3F%23%25/7/issues"
        );
    }

    #[test]
    fn refuses_traversal_and_slashes() {
        let template = PathTemplate::parse("/repos/{owner}/issues").unwrap();
        for evil in ["..", ".", "a/b", "../admin", "..\\x", ""] {
            let error = template.fill(&args(json!({"owner": evil}))).unwrap_err();
            assert!(
                matches!(error, HttpToolError::PathInjection(ref name) if name == "owner"),
                "{evil}: {error:?}"
            );
        }
        // Encoded dots stay literal: `%` is encoded, so no dot segment can appear.
        assert_eq!(
            template.fill(&args(json!({"owner": "%2e%2e"}))).unwrap(),
            "/repos/%252e%252e/issues"
        );
        assert!(matches!(
            template.fill(&args(json!({"owner": {"a": 1}}))),
            Err(HttpToolError::NotScalar(_))
        ));
        assert!(matches!(
            template.fill(&args(json!({}))),
            Err(HttpToolError::MissingPathArgument(_))
        ));
    }

    #[test]
    fn refuses_bad_templates() {
        for bad in [
            "repos", "/a/../b", "/a?x=1", "/{a", "/a}", "/{a-b}", "/{}", "/%2e",
        ] {
            assert!(
                matches!(
                    PathTemplate::parse(bad),
                    Err(HttpToolError::InvalidTemplate { .. })
                ),
                "{bad}"
            );
        }
        let error = HttpToolDefinition::new(HttpToolConfig {
            name: "t".into(),
            description: None,
            method: "GET".into(),
            path: "/x/{undeclared}".into(),
            input_schema: args(json!({"type": "object"})),
        })
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "path parameter `undeclared` is not a property of the input schema"
        );
    }

    #[test]
    fn builds_urls_with_query_or_body() {
        let connection = connection();
        let (url, body) = tool("GET", "/repos/{owner}/issues")
            .build_request(
                &connection,
                &args(json!({"owner": "acme", "title": "a&b", "repo": ["x", 1]})),
            )
            .unwrap();
        assert_eq!(
            url,
            "https://api.example.com/v3/repos/acme/issues?repo=x&repo=1&title=a%26b"
        );
        assert_eq!(body, None);
        let (url, body) = tool("post", "/repos/{owner}/issues")
            .build_request(&connection, &args(json!({"owner": "acme", "title": "hi"})))
            .unwrap();
        assert_eq!(url, "https://api.example.com/v3/repos/acme/issues");
        assert_eq!(body.unwrap(), br#"{"title":"hi"}"#);
    }

    #[test]
    fn base_url_must_be_allowlisted() {
        assert!(matches!(
            HttpApiConnection::new(
                "https://api.example.com",
                HostAllowlist::parse(["other.example.com"]).unwrap(),
                ConnectionCredentials::none()
            ),
            Err(HttpToolError::BaseUrlNotAllowlisted)
        ));
    }

    #[test]
    fn the_pin_covers_method_and_path() {
        let get = tool("GET", "/repos/{owner}/issues").tool_definition();
        let delete = tool("DELETE", "/repos/{owner}/issues").tool_definition();
        let other = tool("GET", "/repos/{owner}/pulls").tool_definition();
        assert_ne!(get.hash(), delete.hash());
        assert_ne!(get.hash(), other.hash());
        assert_eq!(
            get.annotations,
            Some(json!({"http": {"method": "GET", "path": "/repos/{owner}/issues"}}))
        );
    }
}
