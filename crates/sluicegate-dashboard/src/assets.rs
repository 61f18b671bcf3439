//! The single-page app, compiled into the binary: nothing is fetched from elsewhere.

use std::sync::Arc;

use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::Shared;

const INDEX: &str = include_str!("../assets/index.html");
const APP_JS: &str = include_str!("../assets/app.js");
const APP_CSS: &str = include_str!("../assets/app.css");
const LOGIN: &str = include_str!("../assets/login.html");

pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/", get(|| async { page(Html(INDEX)) }))
        .route("/app.js", get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }))
        .route("/app.css", get(|| async { asset("text/css; charset=utf-8", APP_CSS) }))
}

fn page(html: Html<&'static str>) -> Response {
    ([(CACHE_CONTROL, "no-store")], html).into_response()
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(CONTENT_TYPE, content_type), (CACHE_CONTROL, "no-cache")], body).into_response()
}

/// The login form, for `namespace`, with an error line when the last try failed.
pub(crate) fn login_page(namespace: &str, error: Option<&str>) -> String {
    let error = error.map(|e| format!("<p class=\"error\">{}</p>", escape(e))).unwrap_or_default();
    LOGIN
        .replace("{{namespace}}", &escape(namespace))
        .replace("{{error}}", &error)
        .replace("{{css}}", APP_CSS)
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}
