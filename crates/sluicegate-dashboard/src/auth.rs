//! Who may look and who may act: the bearer token, the login form's session cookie, and the
//! [`Who`] an action is logged with.
//!
//! Without a token every request is let in (the CLI allows that on loopback addresses only).
//! With one, a request carries it as `Authorization: Bearer <token>`, or carries the session
//! cookie the login form set (random, kept in memory: a restart logs browsers out). A wrong
//! token is answered 401, also when a valid cookie comes with it. The cookie is `HttpOnly` and
//! `SameSite=Strict`, and actions take JSON bodies only, so another site cannot make a logged-in
//! browser act.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::{ConnectInfo, FromRequestParts, Request, State};
use axum::http::header::{AUTHORIZATION, COOKIE, LOCATION, SET_COOKIE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use rand::Rng;

use crate::error::ApiError;
use crate::Shared;

/// The session cookie's name.
const COOKIE_NAME: &str = "sluicegate_session";

/// Sessions kept at most; the oldest is forgotten first.
const MAX_SESSIONS: usize = 1_000;

/// The login form's sessions.
#[derive(Default)]
pub(crate) struct Sessions {
    ids: Mutex<VecDeque<String>>,
}

impl Sessions {
    fn open(&self) -> String {
        let id: String = (0..32).map(|_| format!("{:x}", rand::thread_rng().gen::<u8>() & 0xf)).collect();
        let mut ids = self.ids.lock().unwrap_or_else(PoisonError::into_inner);
        if ids.len() >= MAX_SESSIONS {
            ids.pop_front();
        }
        ids.push_back(id.clone());
        id
    }

    fn knows(&self, id: &str) -> bool {
        let ids = self.ids.lock().unwrap_or_else(PoisonError::into_inner);
        ids.iter().any(|known| same(known, id))
    }

    fn close(&self, id: &str) {
        self.ids.lock().unwrap_or_else(PoisonError::into_inner).retain(|known| !same(known, id));
    }
}

/// How a request got in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// No token is configured.
    Open,
    /// It carried the bearer token.
    Token,
    /// It carried a login session's cookie.
    Session,
}

impl Access {
    fn as_str(self) -> &'static str {
        match self {
            Self::Open => "no token configured",
            Self::Token => "bearer token",
            Self::Session => "login session",
        }
    }
}

/// Who sent a request: the peer's address (when served with connect info) and how it got in.
#[derive(Clone, Debug)]
pub(crate) struct Who {
    pub(crate) peer: Option<SocketAddr>,
    pub(crate) access: Access,
}

impl std::fmt::Display for Who {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.peer {
            Some(peer) => write!(f, "{peer} ({})", self.access.as_str()),
            None => write!(f, "unknown peer ({})", self.access.as_str()),
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Who {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let peer = parts.extensions.get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
        let access = parts.extensions.get::<Access>().copied().unwrap_or(Access::Open);
        Ok(Who { peer, access })
    }
}

/// Compares two secrets in time that does not depend on where they differ.
fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn session_cookie(headers: &HeaderMap) -> Option<String> {
    headers.get_all(COOKIE).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(';')).find_map(|c| {
        let (name, value) = c.trim().split_once('=')?;
        (name == COOKIE_NAME).then(|| value.to_owned())
    })
}

/// Lets a request in, or answers 401 (the API, `/metrics`) or sends a browser to the login form
/// (the pages).
pub(crate) async fn require(State(shared): State<Arc<Shared>>, mut request: Request, next: Next) -> Response {
    let access = match &shared.options.token {
        None => Access::Open,
        Some(token) => {
            let bearer = request.headers().get(AUTHORIZATION).map(|v| v.to_str().unwrap_or("").to_owned());
            match bearer {
                Some(value) => match value.strip_prefix("Bearer ") {
                    Some(given) if same(given.trim(), token) => Access::Token,
                    _ => return ApiError::new(
                        StatusCode::UNAUTHORIZED,
                        "wrong token: the Authorization header must be \"Bearer <the dashboard's --token>\"",
                    )
                    .into_response(),
                },
                None => match session_cookie(request.headers()) {
                    Some(id) if shared.sessions.knows(&id) => Access::Session,
                    _ => return refuse(request.uri().path()),
                },
            }
        }
    };
    request.extensions_mut().insert(access);
    next.run(request).await
}

/// The answer to a request without credentials.
fn refuse(path: &str) -> Response {
    if path.starts_with("/api/") || path == "/metrics" {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "this dashboard needs its token: send \"Authorization: Bearer <token>\", or log in at /login",
        )
        .into_response();
    }
    (StatusCode::SEE_OTHER, [(LOCATION, "/login")]).into_response()
}

/// `/login` (the form, and its post) and `/logout`: outside the guard.
pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new().route("/login", get(login_form).post(login)).route("/logout", post(logout))
}

async fn login_form(State(shared): State<Arc<Shared>>) -> Response {
    if shared.options.token.is_none() {
        return (StatusCode::SEE_OTHER, [(LOCATION, "/")]).into_response();
    }
    Html(crate::assets::login_page(&shared.namespace, None)).into_response()
}

#[derive(serde::Deserialize)]
struct LoginForm {
    token: String,
}

async fn login(State(shared): State<Arc<Shared>>, who: Who, Form(form): Form<LoginForm>) -> Response {
    let Some(token) = &shared.options.token else {
        return (StatusCode::SEE_OTHER, [(LOCATION, "/")]).into_response();
    };
    if !same(form.token.trim(), token) {
        tracing::warn!(peer = %who, "dashboard login refused: wrong token");
        let page = crate::assets::login_page(&shared.namespace, Some("Wrong token."));
        return (StatusCode::UNAUTHORIZED, Html(page)).into_response();
    }
    let id = shared.sessions.open();
    tracing::info!(peer = %who, "dashboard login");
    let cookie = format!("{COOKIE_NAME}={id}; Path=/; HttpOnly; SameSite=Strict");
    (StatusCode::SEE_OTHER, [(SET_COOKIE, cookie), (LOCATION, "/".to_owned())]).into_response()
}

async fn logout(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Some(id) = session_cookie(&headers) {
        shared.sessions.close(&id);
    }
    let cookie = format!("{COOKIE_NAME}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0");
    (StatusCode::SEE_OTHER, [(SET_COOKIE, cookie), (LOCATION, "/login".to_owned())]).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_whole() {
        assert!(same("abc", "abc"));
        assert!(!same("abc", "abd"));
        assert!(!same("abc", "abcd"));
        assert!(!same("", "a"));
    }

    #[test]
    fn the_session_cookie_is_found_among_others() {
        let mut headers = HeaderMap::new();
        headers.insert(COOKIE, "a=1; sluicegate_session=f00; b=2".parse().unwrap_or_else(|_| unreachable!()));
        assert_eq!(session_cookie(&headers).as_deref(), Some("f00"));
    }
}
