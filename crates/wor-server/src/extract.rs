//! Request extractors that turn every rejection into the API's one error shape.

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A JSON body. Request types use `#[serde(deny_unknown_fields)]`, so a misspelt field is an
/// error rather than a silent default.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(value)) => Ok(ApiJson(value)),
            Err(rejection) => Err(json_rejection(rejection)),
        }
    }
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
            Err(PathRejection::FailedToDeserializePathParams(e)) => {
                Err(ApiError::bad_request("invalid_id", e.body_text()))
            }
            Err(other) => Err(ApiError::bad_request("invalid_path", other.body_text())),
        }
    }
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

/// An optional id from a query string, e.g. `run_id=run_…`; a malformed one is a 400.
pub fn query_id<T>(text: Option<&str>) -> Result<Option<T>, ApiError>
where
    T: std::str::FromStr<Err = wor_core::IdError>,
{
    text.map(str::parse::<T>)
        .transpose()
        .map_err(|e| ApiError::bad_request("invalid_id", e.to_string()))
}
