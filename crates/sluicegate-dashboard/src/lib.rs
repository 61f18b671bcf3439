//! A live web dashboard for one sluicegate namespace, and the JSON API it runs on.
//!
//! `sluicegate dashboard --listen 127.0.0.1:8080` serves it (docs/dashboard.md is the manual); a
//! program can mount it in its own axum server with [`Dashboard::router`]. Kept out of the
//! `sluicegate` library so that a program embedding workers pulls in no HTTP server.
//!
//! What it is made of, one module per concept:
//! - `api`: the JSON endpoints (`/api/...`), read-only ones and actions, over [`sluicegate::Admin`];
//! - `live`: the hub that reads the namespace once per interval, whoever watches, and fans the
//!   reading and every completion event (from a [`sluicegate::Listener`]) out to each browser as
//!   server-sent events: the Redis cost of a dashboard does not grow with its viewers;
//! - `graph`: a request's neighbourhood among the requests it runs after and before;
//! - `auth`: the bearer token, the login form and its session cookie, and who did what;
//! - `assets`: the single-page app (HTML, vanilla JS, CSS) compiled into the binary: nothing is
//!   fetched from elsewhere, and it works offline.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use sluicegate::{Admin, Config};
//! use sluicegate_dashboard::{Dashboard, DashboardOptions};
//!
//! let config = Config::from_env();
//! let admin = Admin::connect(&config).await?;
//! let dashboard = Dashboard::new(admin, &config, DashboardOptions::new().allow_actions(true));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! dashboard.serve(listener).await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod api;
mod assets;
mod auth;
mod error;
mod graph;
mod live;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use sluicegate::{Admin, Config};

/// How a [`Dashboard`] behaves: read-only or not, its token, how often it reads the namespace.
///
/// ```
/// use std::time::Duration;
/// use sluicegate_dashboard::DashboardOptions;
/// let options = DashboardOptions::new().allow_actions(true).token("s3cret").interval(Duration::from_secs(5));
/// assert!(options.actions_allowed());
/// ```
#[derive(Clone, Debug)]
pub struct DashboardOptions {
    allow_actions: bool,
    token: Option<String>,
    interval: Duration,
    throughput_interval: Duration,
    tally_interval: Duration,
}

impl Default for DashboardOptions {
    fn default() -> Self {
        Self {
            allow_actions: false,
            token: None,
            interval: Duration::from_secs(2),
            throughput_interval: Duration::from_secs(10),
            tally_interval: Duration::from_secs(10),
        }
    }
}

impl DashboardOptions {
    /// Read-only, no token, a reading every 2 s.
    pub fn new() -> Self {
        Self::default()
    }

    /// Allows actions (cancel, requeue dead letters, reprioritize, purge, pause, resume). Off by
    /// default: the API answers 403 to them and the pages show no buttons.
    pub fn allow_actions(mut self, on: bool) -> Self {
        self.allow_actions = on;
        self
    }

    /// Requires this token of every request: as `Authorization: Bearer <token>`, or through the
    /// login form, which sets a session cookie. An empty token is taken as none.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        let token = token.into();
        self.token = (!token.is_empty()).then_some(token);
        self
    }

    /// How often the namespace is read while at least one browser watches (default 2 s; at least
    /// 100 ms). One reading serves every browser.
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_millis(100));
        self
    }

    /// How often the throughput chart's per-minute counts are read again (default 10 s; they
    /// change once a minute, and reach Redis once per flush interval of each component).
    pub fn throughput_interval(mut self, interval: Duration) -> Self {
        self.throughput_interval = interval.max(Duration::from_millis(100));
        self
    }

    /// How often a reading re-reads the tally (token capacity, parked tokens, dead letters: one
    /// record per unfinished request, up to `sluicegate::MAX_TALLY`) once it covers more than
    /// 1,000 records (default 10 s); a smaller tally is read at every reading. Between two
    /// tallies a reading carries the last one and no drift (the totals would not balance).
    pub fn tally_interval(mut self, interval: Duration) -> Self {
        self.tally_interval = interval;
        self
    }

    /// Whether actions are allowed.
    pub fn actions_allowed(&self) -> bool {
        self.allow_actions
    }

    /// Whether a token is required.
    pub fn token_required(&self) -> bool {
        self.token.is_some()
    }
}

/// What every handler shares.
struct Shared {
    admin: Admin,
    namespace: String,
    token_shards: u32,
    options: DashboardOptions,
    metrics: sluicegate_metrics::NamespaceExporter,
    live: live::Hub,
    sessions: auth::Sessions,
}

/// The dashboard of one namespace: its pages, its JSON API, its live stream and `/metrics`.
/// Cheap to clone; the background readings stop when the last clone (and every router made
/// from it) is dropped.
#[derive(Clone)]
pub struct Dashboard {
    shared: Arc<Shared>,
}

impl Dashboard {
    /// A dashboard of the namespace `admin` is connected to (`config` names it and says how to
    /// reach Redis for the events listener).
    pub fn new(admin: Admin, config: &Config, options: DashboardOptions) -> Self {
        let namespace = config.namespace_str().to_owned();
        let metrics = sluicegate_metrics::NamespaceExporter::new(&namespace, admin.clone());
        let live = live::Hub::new(admin.clone(), config.clone(), &options);
        Self {
            shared: Arc::new(Shared {
                admin,
                namespace,
                token_shards: config.token_shard_count(),
                options,
                metrics,
                live,
                sessions: auth::Sessions::default(),
            }),
        }
    }

    /// The routes: the pages at `/`, the API under `/api/`, `/metrics`, `/login`. Serve it with
    /// `into_make_service_with_connect_info::<SocketAddr>()` so that actions are logged with the
    /// peer's address. Call within a Tokio runtime.
    pub fn router(&self) -> Router {
        let shared = self.shared.clone();
        let app = Router::new()
            .merge(assets::routes())
            .merge(api::routes(&shared))
            .route_layer(axum::middleware::from_fn_with_state(shared.clone(), auth::require));
        app.merge(auth::routes()).with_state(shared)
    }

    /// Serves [`router`](Self::router) on `listener` until the task is dropped or aborted.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        let app = self.router();
        axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await
    }
}
