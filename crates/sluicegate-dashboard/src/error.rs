//! The API's errors: a status code and a message that names the problem, as JSON
//! `{"error": "..."}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

/// An API error.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }

    /// 400: a parameter or body is malformed.
    pub(crate) fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

impl From<sluicegate::Error> for ApiError {
    fn from(e: sluicegate::Error) -> Self {
        use sluicegate::Error as E;
        // The functions library refusing an argument, passed on as Redis's reply (its
        // `reprioritize` of a request in a tenant group does): the request refuses the action.
        if let E::Redis(r) = &e {
            if r.code() == Some("SGINVALID") {
                let why = r.message().trim_start_matches("SGINVALID").trim_start();
                return Self::new(StatusCode::CONFLICT, format!("refused: {why}"));
            }
        }
        let status = match &e {
            E::InvalidRequestId(_) | E::InvalidRequest(_) | E::InvalidCursor(_) => StatusCode::BAD_REQUEST,
            E::UnknownRequest(_) => StatusCode::NOT_FOUND,
            E::NoDeadLetters(_) | E::Refused(_) | E::NotOpen(_) | E::DuplicateRequestId(_) => {
                StatusCode::CONFLICT
            }
            E::Redis(_) | E::Timeout(_) | E::Shutdown => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Self::new(status, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(serde_json::json!({ "error": self.message }))).into_response()
    }
}

/// What a handler returns.
pub(crate) type ApiResult<T> = Result<T, ApiError>;
