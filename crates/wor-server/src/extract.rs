//! Request extractors that turn every rejection into the API's one error shape.

use axum::body::Bytes;
use axum::extract::path::ErrorKind;
use axum::extract::rejection::{BytesRejection, JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use serde::de::DeserializeOwned;
use serde_json::Value;
use wor_core::json_depth::MAX_JSON_NESTING;

use crate::error::ApiError;

/// A JSON body, which must be an object. Request types use `#[serde(deny_unknown_fields)]`, so a
/// misspelt field is an error rather than a silent default.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = json_body(req, state).await?;
        object(&bytes).map(ApiJson)
    }
}

/// A JSON object read into `T`. Anything else is refused before `T` sees it: serde would read
/// an array into a struct, field by field in order, past `deny_unknown_fields`.
fn object<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if !opens_an_object(bytes) {
        return Err(ApiError::bad_request(
            "invalid_body",
            "the body must be a JSON object",
        ));
    }
    match axum::Json::<T>::from_bytes(bytes) {
        Ok(axum::Json(value)) => Ok(value),
        Err(rejection) => Err(json_rejection(rejection)),
    }
}

/// Whether JSON text `bytes` is an object, by its first character after any white space: what
/// must hold before serde reads it into a struct.
pub(crate) fn opens_an_object(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .find(|byte| !matches!(byte, b' ' | b'\t' | b'\n' | b'\r'))
        == Some(&b'{')
}

/// The body of a request that says it is JSON, within the size and nesting limits and free
/// of U+0000; not yet parsed.
async fn json_body<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError> {
    if !json_content_type(req.headers()) {
        return Err(ApiError::UnsupportedMediaType);
    }
    let bytes = Bytes::from_request(req, state)
        .await
        .map_err(bytes_rejection)?;
    let nesting = wor_core::json_depth::text_nesting(&bytes);
    if nesting > MAX_JSON_NESTING {
        return Err(ApiError::bad_request(
            "invalid_json",
            format!("the body nests arrays and objects deeper than {MAX_JSON_NESTING} levels"),
        ));
    }
    // PostgreSQL text cannot hold U+0000, so no input may carry it, on any backend.
    if let Some(field) = field_with_nul(&bytes) {
        return Err(ApiError::bad_request(
            "invalid_body",
            format!("{field} contains a NUL character (U+0000)"),
        ));
    }
    Ok(bytes)
}

/// A JSON body that may be left out: no body (and no `Content-Type`) or a JSON `null` is
/// `None`; anything else is read exactly as [`ApiJson`] reads it, an object.
#[derive(Debug)]
pub struct OptionalApiJson<T>(pub Option<T>);

impl<S, T> FromRequest<S> for OptionalApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        if req.headers().contains_key(header::CONTENT_TYPE) {
            let bytes = json_body(req, state).await?;
            if bytes.trim_ascii() == b"null" {
                return Ok(OptionalApiJson(None));
            }
            return object(&bytes).map(|value| OptionalApiJson(Some(value)));
        }
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(bytes_rejection)?;
        if bytes.is_empty() {
            Ok(OptionalApiJson(None))
        } else {
            Err(ApiError::UnsupportedMediaType)
        }
    }
}

/// `application/json`, or any `application/…+json`, as axum's own `Json` accepts.
fn json_content_type(headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .strip_prefix("application/")
            .is_some_and(|subtype| subtype.ends_with("+json"))
}

/// Which top-level field of a JSON body holds U+0000 (written `\u0000`; JSON has no other
/// way to carry it), as `` `name` `` or "the body"; `None` when nothing does. Bodies that are
/// not JSON are left to the parser.
fn field_with_nul(body: &[u8]) -> Option<String> {
    // Cheap first: most bodies have no `\u0000` at all.
    if !body.windows(6).any(|w| w == b"\\u0000") {
        return None;
    }
    let value: Value = serde_json::from_slice(body).ok()?;
    let mut found = None;
    if let Value::Object(map) = &value {
        found = map
            .iter()
            .find(|(key, field)| key.contains('\0') || wor_core::text::json_holds_nul(field))
            .map(|(key, _)| format!("`{key}`"));
    }
    found.or_else(|| wor_core::text::json_holds_nul(&value).then(|| "the body".to_owned()))
}

/// Why JSON typed into a console form field is refused.
#[derive(Debug, thiserror::Error)]
pub enum JsonFieldError {
    #[error("it nests arrays and objects deeper than {MAX_JSON_NESTING} levels")]
    TooDeep,
    #[error("not valid JSON: {0}")]
    Invalid(#[from] serde_json::Error),
    #[error("it contains a NUL character (U+0000)")]
    Nul,
}

/// JSON typed into a console form field, held to what an API body is held to: within the
/// nesting limit (what is stored must read back) and free of U+0000 (which PostgreSQL text
/// cannot hold).
pub fn json_field(text: &str) -> Result<Value, JsonFieldError> {
    if wor_core::json_depth::text_nesting(text.as_bytes()) > MAX_JSON_NESTING {
        return Err(JsonFieldError::TooDeep);
    }
    let value: Value = serde_json::from_str(text)?;
    if wor_core::text::json_holds_nul(&value) {
        return Err(JsonFieldError::Nul);
    }
    Ok(value)
}

fn json_rejection(rejection: JsonRejection) -> ApiError {
    match rejection {
        JsonRejection::MissingJsonContentType(_) => ApiError::UnsupportedMediaType,
        JsonRejection::JsonSyntaxError(e) => {
            ApiError::bad_request("invalid_json", format!("malformed JSON: {}", e.body_text()))
        }
        JsonRejection::JsonDataError(e) => ApiError::bad_request(
            "invalid_body",
            format!("invalid request body: {}", e.body_text()),
        ),
        other if other.status() == StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge,
        other => ApiError::bad_request("invalid_body", other.body_text()),
    }
}

/// A raw body, taken as it came (an inbound webhook's). Over [`crate::MAX_BODY_BYTES`] it is a
/// 413 and any other failure to read it a 400, both in the one error shape.
#[derive(Debug)]
pub struct ApiBytes(pub Bytes);

impl<S> FromRequest<S> for ApiBytes
where
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        Bytes::from_request(req, state)
            .await
            .map(ApiBytes)
            .map_err(bytes_rejection)
    }
}

fn bytes_rejection(rejection: BytesRejection) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::PayloadTooLarge
    } else {
        ApiError::bad_request("invalid_body", rejection.body_text())
    }
}

/// Path parameters, such as a typed id; a malformed id is a 400 naming what was expected.
#[derive(Debug)]
pub struct ApiPath<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(ApiPath(value)),
            // The id's own message, without the prefix axum gives it about URLs: the URL is
            // well formed, the id in it is not.
            Err(PathRejection::FailedToDeserializePathParams(e)) => match e.into_kind() {
                ErrorKind::Message(message) | ErrorKind::DeserializeError { message, .. } => {
                    Err(ApiError::bad_request("invalid_id", message))
                }
                ErrorKind::WrongNumberOfParameters { .. } | ErrorKind::UnsupportedType { .. } => {
                    Err(handler_asks_wrong_parameters())
                }
                other => Err(ApiError::bad_request("invalid_id", other.to_string())),
            },
            Err(PathRejection::MissingPathParams(_)) => Err(handler_asks_wrong_parameters()),
            Err(other) => Err(ApiError::bad_request("invalid_path", other.body_text())),
        }
    }
}

/// A handler whose path parameters do not fit its route: this server's fault, not the caller's.
fn handler_asks_wrong_parameters() -> ApiError {
    tracing::error!(
        category = "http",
        "a handler asks for path parameters its route does not have"
    );
    ApiError::Internal
}

/// Query parameters; a malformed one is a 400 naming it.
#[derive(Debug)]
pub struct ApiQuery<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(ApiQuery(value)),
            Err(QueryRejection::FailedToDeserializeQueryString(e)) => {
                Err(ApiError::bad_request("invalid_query", e.body_text()))
            }
            Err(other) => Err(ApiError::bad_request("invalid_query", other.body_text())),
        }
    }
}

/// The page size of a listing: 1 to 200, 50 when not given.
pub fn page_limit(limit: Option<u32>) -> Result<u32, ApiError> {
    let limit = limit.unwrap_or(50);
    if (1..=200).contains(&limit) {
        Ok(limit)
    } else {
        Err(ApiError::bad_request(
            "invalid_query",
            "`limit` must be between 1 and 200",
        ))
    }
}

/// A page cursor from a query string (`before=`): the id of a row of the listing, `prefix_`
/// and 32 hex digits, naming it `what` in the 400 a malformed one gets. Anything else could
/// name no row, and would answer a page as if it did.
pub fn page_cursor(
    before: Option<String>,
    prefix: &str,
    what: &str,
) -> Result<Option<String>, ApiError> {
    match before {
        Some(id) if wor_core::ids::id_digits(&id, prefix).is_none() => Err(ApiError::bad_request(
            "invalid_query",
            format!("`before` is not {what} id (`{prefix}_` and 32 hex digits)"),
        )),
        other => Ok(other),
    }
}

/// An optional id from a query string, e.g. `run_id=run_…`; a malformed one is a 400.
pub fn query_id<T>(text: Option<&str>) -> Result<Option<T>, ApiError>
where
    T: std::str::FromStr<Err = wor_core::IdError>,
{
    text.map(str::parse::<T>)
        .transpose()
        .map_err(|e| ApiError::bad_request("invalid_id", e.to_string()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail loudly")]
    use super::*;

    /// JSON typed into a console field is held to an API body's limits: what is stored reads
    /// back, and PostgreSQL can hold it.
    #[test]
    fn a_json_field_is_held_to_the_limits_of_a_body() {
        let nested = |levels: usize| format!("{}{}", "[".repeat(levels), "]".repeat(levels));
        assert_eq!(
            json_field(&nested(MAX_JSON_NESTING)).unwrap(),
            serde_json::from_str::<Value>(&nested(MAX_JSON_NESTING)).unwrap()
        );
        // serde_json alone reads up to 127 levels; what it stores then does not read back.
        assert!(matches!(
            json_field(&nested(MAX_JSON_NESTING + 1)),
            Err(JsonFieldError::TooDeep)
        ));
        assert!(matches!(
            json_field(r#"{"a": ["x\u0000y"]}"#),
            Err(JsonFieldError::Nul)
        ));
        assert!(matches!(
            json_field(r#"{"\u0000": 1}"#),
            Err(JsonFieldError::Nul)
        ));
        assert_eq!(
            json_field(r#"{"a": "x\\u0000y"}"#).unwrap(),
            serde_json::json!({"a": "x\\u0000y"}),
            "an escaped backslash before `u0000` is no NUL"
        );
        assert!(matches!(json_field("{"), Err(JsonFieldError::Invalid(_))));
    }
}
