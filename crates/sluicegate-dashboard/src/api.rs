//! The JSON API (docs/dashboard.md): read-only endpoints over [`sluicegate::Admin`], the live
//! stream, `/metrics`, and the actions, which answer 403 unless the dashboard allows them.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sluicegate::{ListQuery, ListState, Priority, RequestId};

use crate::auth::Who;
use crate::error::{ApiError, ApiResult};
use crate::Shared;

/// The content type of OpenMetrics text.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Characters of a dead letter's payload (as JSON text) shown unless the whole is asked for.
const PAYLOAD_PREVIEW: usize = 256;

/// Dead letters one page lists by default, and at most.
const DEAD_PAGE: usize = 50;
const DEAD_PAGE_MAX: usize = 1_000;

/// Requests the token audit reads by default.
const AUDIT_PAGE: u32 = 100;

pub(crate) fn routes(shared: &Arc<Shared>) -> Router<Arc<Shared>> {
    let actions = Router::new()
        .route("/api/requests/{id}/cancel", post(cancel))
        .route("/api/requests/{id}/requeue", post(requeue))
        .route("/api/requests/{id}/reprioritize", post(reprioritize))
        .route("/api/requests/{id}/purge", post(purge))
        .route("/api/pause", post(pause))
        .route("/api/resume", post(resume))
        .route_layer(axum::middleware::from_fn_with_state(shared.clone(), actions_allowed));
    Router::new()
        .route("/api/config", get(config))
        .route("/api/overview", get(overview))
        .route("/api/stats", get(stats))
        .route("/api/throughput", get(throughput))
        .route("/api/requests", get(list))
        .route("/api/requests/{id}", get(status))
        .route("/api/requests/{id}/dead", get(dead))
        .route("/api/requests/{id}/tokens", get(tokens))
        .route("/api/requests/{id}/graph", get(graph))
        .route("/api/workers", get(workers))
        .route("/api/events", get(events))
        .route("/api/tokens", get(token_audit))
        .route("/api/groups", get(groups))
        .route("/api/groups/{name}", get(group))
        .route("/api/live", get(live))
        .route("/metrics", get(metrics))
        .merge(actions)
        .route("/api/{*rest}", any(unknown))
}

/// Refuses every action of a read-only dashboard.
async fn actions_allowed(
    State(shared): State<Arc<Shared>>,
    who: Who,
    request: Request,
    next: Next,
) -> Response {
    if !shared.options.allow_actions {
        tracing::info!(peer = %who, path = %request.uri().path(), "dashboard action refused: read-only");
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "actions are disabled: this dashboard is read-only (start it with --allow-actions to cancel, requeue, reprioritize, purge, pause or resume)",
        )
        .into_response();
    }
    next.run(request).await
}

async fn unknown(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "no API endpoint {} {} (docs/dashboard.md lists them)",
            request.method(),
            request.uri().path()
        ),
    )
}

fn request_id(raw: &str) -> ApiResult<RequestId> {
    RequestId::new(raw).map_err(|e| ApiError::from(sluicegate::Error::from(e)))
}

fn priority(n: i64) -> ApiResult<Priority> {
    u8::try_from(n)
        .ok()
        .and_then(|p| Priority::new(p).ok())
        .ok_or_else(|| ApiError::bad(format!("priority {n} is out of range: 0 to 99")))
}

async fn config(State(shared): State<Arc<Shared>>) -> Json<Value> {
    Json(json!({
        "namespace": shared.namespace,
        "token_shards": shared.token_shards,
        "actions": shared.options.allow_actions,
        "token_required": shared.options.token.is_some(),
        "interval_ms": shared.options.interval.as_millis() as u64,
        "version": env!("CARGO_PKG_VERSION"),
    }))
}

fn json_text(text: Arc<str>) -> Response {
    ([(CONTENT_TYPE, "application/json")], text.to_string()).into_response()
}

async fn overview(State(shared): State<Arc<Shared>>) -> ApiResult<Response> {
    Ok(json_text(shared.live.overview().await?))
}

async fn stats(State(shared): State<Arc<Shared>>) -> ApiResult<Json<sluicegate::Stats>> {
    Ok(Json(shared.admin.stats().await?))
}

async fn throughput(State(shared): State<Arc<Shared>>) -> ApiResult<Json<Value>> {
    let t = shared.live.throughput().await?;
    Ok(Json(json!(&*t)))
}

/// `/api/requests?state=&priority=&tag=&tracked=&older_than=&limit=&cursor=`.
async fn list(
    State(shared): State<Arc<Shared>>,
    Query(params): Query<HashMap<String, String>>,
) -> ApiResult<Json<sluicegate::ListPage>> {
    let mut query = ListQuery::new();
    for (name, value) in &params {
        if value.is_empty() {
            continue;
        }
        query = match name.as_str() {
            "state" => query.state(value.parse::<ListState>()?),
            "priority" => {
                let n: i64 = value
                    .parse()
                    .map_err(|_| ApiError::bad(format!("priority {value:?} is not a number")))?;
                query.priority(priority(n)?)
            }
            "tag" => query.tag(value.clone()),
            "tracked" => match value.as_str() {
                "true" | "1" => query.tracked(),
                "false" | "0" => query,
                _ => return Err(ApiError::bad(format!("tracked {value:?} is not true or false"))),
            },
            "older_than" => query.older_than(humantime::parse_duration(value).map_err(|e| {
                ApiError::bad(format!("older_than {value:?} is not a duration like 90s, 15m or 2h: {e}"))
            })?),
            "limit" => query.limit(value.parse().map_err(|_| {
                ApiError::bad(format!(
                    "limit {value:?} is not a number from 1 to {}",
                    sluicegate::MAX_LIST_LIMIT
                ))
            })?),
            "cursor" => query.cursor(value.clone()),
            other => {
                return Err(ApiError::bad(format!(
                    "unknown parameter {other:?}: state, priority, tag, tracked, older_than, limit, cursor"
                )))
            }
        };
    }
    Ok(Json(shared.admin.list(&query).await?))
}

/// A request's status, with its completion event when the dashboard saw it.
async fn status(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    let id = request_id(&id)?;
    let status = shared.admin.status(&id).await?;
    let event = shared.live.events().into_iter().find(|e| e.id == id.as_str());
    let mut body = json!(status);
    body["completion"] = json!(event);
    Ok(Json(body))
}

#[derive(Deserialize)]
struct DeadParams {
    /// Dead letters to list (default 50).
    limit: Option<usize>,
    /// Only this one, with its whole payload.
    index: Option<u64>,
}

#[derive(Serialize)]
struct DeadRow {
    index: u64,
    error: sluicegate::PartError,
    /// The payload decoded (MessagePack to JSON where it is; else text, else bytes as hex), cut
    /// at 256 characters of its JSON text unless `index` asked for this one.
    payload: Value,
    payload_bytes: usize,
    truncated: bool,
}

fn payload_value(bytes: &[u8]) -> Value {
    sluicegate::codec::decode::<Value>(bytes).unwrap_or_else(|_| match std::str::from_utf8(bytes) {
        Ok(text) => Value::String(text.to_owned()),
        Err(_) => Value::String(bytes.iter().map(|b| format!("{b:02x}")).collect()),
    })
}

async fn dead(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    Query(params): Query<DeadParams>,
) -> ApiResult<Json<Value>> {
    let id = request_id(&id)?;
    let limit = params.limit.unwrap_or(DEAD_PAGE);
    if limit == 0 || limit > DEAD_PAGE_MAX {
        return Err(ApiError::bad(format!("limit {limit} is out of range: 1 to {DEAD_PAGE_MAX}")));
    }
    let dead = shared.admin.dead(&id).await?;
    let total = dead.len();
    let rows: Vec<DeadRow> = dead
        .into_iter()
        .filter(|d| params.index.is_none_or_eq(d.index))
        .take(limit)
        .map(|d| {
            let value = payload_value(&d.payload);
            let text = value.to_string();
            let whole = params.index.is_some() || text.chars().count() <= PAYLOAD_PREVIEW;
            let payload =
                if whole { value } else { Value::String(text.chars().take(PAYLOAD_PREVIEW).collect()) };
            DeadRow {
                index: d.index,
                error: d.error,
                payload,
                payload_bytes: d.payload.len(),
                truncated: !whole,
            }
        })
        .collect();
    if let (Some(index), true) = (params.index, rows.is_empty()) {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("request \"{id}\" has no dead letter at index {index}"),
        ));
    }
    Ok(Json(json!({ "id": id.as_str(), "total": total, "dead": rows })))
}

/// `Option::is_none_or` for MSRV 1.80.
trait NoneOrEq {
    fn is_none_or_eq(&self, v: u64) -> bool;
}

impl NoneOrEq for Option<u64> {
    fn is_none_or_eq(&self, v: u64) -> bool {
        self.map_or(true, |x| x == v)
    }
}

async fn tokens(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> ApiResult<Json<sluicegate::RequestTokens>> {
    let id = request_id(&id)?;
    Ok(Json(shared.admin.tokens(&id).await?))
}

/// `/api/requests/{id}/graph?depth=&limit=`: the request's neighbourhood among the requests it
/// runs after and before (`crate::graph`).
async fn graph(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    Query(params): Query<HashMap<String, String>>,
) -> ApiResult<Json<crate::graph::Graph>> {
    let id = request_id(&id)?;
    let bounded = |name: &str, max: usize| -> ApiResult<usize> {
        let Some(value) = params.get(name).filter(|v| !v.is_empty()) else { return Ok(max) };
        value
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| ApiError::bad(format!("{name} {value:?} is not a number from 1 to {max}")))
    };
    if let Some(other) = params.keys().find(|k| !["depth", "limit"].contains(&k.as_str())) {
        return Err(ApiError::bad(format!("unknown parameter {other:?}: depth, limit")));
    }
    let depth = bounded("depth", crate::graph::MAX_DEPTH)?;
    let limit = bounded("limit", crate::graph::MAX_NODES)?;
    Ok(Json(crate::graph::neighbourhood(&shared.admin, &id, depth, limit).await?))
}

async fn workers(State(shared): State<Arc<Shared>>) -> ApiResult<Json<Value>> {
    let workers = shared.admin.workers().await?;
    Ok(Json(json!({ "workers": workers })))
}

async fn events(State(shared): State<Arc<Shared>>) -> Json<Value> {
    Json(json!({ "events": shared.live.events() }))
}

#[derive(Deserialize)]
struct AuditParams {
    limit: Option<u32>,
}

async fn token_audit(
    State(shared): State<Arc<Shared>>,
    Query(params): Query<AuditParams>,
) -> ApiResult<Json<Value>> {
    let audit = shared.admin.token_audit(params.limit.unwrap_or(AUDIT_PAGE)).await?;
    let stats: Value = serde_json::from_str(&shared.live.overview().await?)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let rows: Vec<Value> = audit
        .requests
        .iter()
        .map(|r| {
            let mut row = json!(r);
            row["drift"] = json!(r.drift());
            if let Some(row) = row.as_object_mut() {
                row.remove("tokens");
            }
            row
        })
        .collect();
    Ok(Json(json!({
        "requests": rows,
        "unfinished": audit.unfinished,
        "totals": stats["tokens"],
        "token_shards": shared.token_shards,
    })))
}

/// Every tenant group in use or configured, by name (`Admin::groups`, at most
/// `sluicegate::MAX_GROUPS_LISTED`).
async fn groups(State(shared): State<Arc<Shared>>) -> ApiResult<Json<Value>> {
    let groups = shared.admin.groups().await?;
    Ok(Json(json!({ "groups": groups, "default_limit": sluicegate::DEFAULT_GROUP_LIMIT })))
}

/// One tenant group (an unknown one reads as idle, with the default limit).
async fn group(
    State(shared): State<Arc<Shared>>,
    Path(name): Path<String>,
) -> ApiResult<Json<sluicegate::GroupStatus>> {
    Ok(Json(shared.admin.group(&name).await?))
}

async fn live(State(shared): State<Arc<Shared>>) -> Response {
    shared.live.stream().into_response()
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    match shared.metrics.text().await {
        Ok(text) => ([(CONTENT_TYPE, OPENMETRICS)], text).into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}

// Actions. Each takes a JSON body (`{}` when it needs nothing): a form on another site cannot send
// one without the browser asking first, which the dashboard never allows.

async fn cancel(
    State(shared): State<Arc<Shared>>,
    who: Who,
    Path(id): Path<String>,
    Json(_): Json<Value>,
) -> ApiResult<Json<Value>> {
    let id = request_id(&id)?;
    let cancelled = shared.admin.cancel(&id).await?;
    tracing::info!(peer = %who, action = "cancel", request = %id, outcome = ?cancelled, "dashboard action");
    let (now, finished_before) = match cancelled {
        sluicegate::Cancelled::Now => (true, None),
        sluicegate::Cancelled::AlreadyFinished(state) => (false, Some(state)),
        _ => (false, None),
    };
    Ok(Json(json!({ "id": id.as_str(), "cancelled": now, "already_finished": finished_before })))
}

async fn requeue(
    State(shared): State<Arc<Shared>>,
    who: Who,
    Path(id): Path<String>,
    Json(_): Json<Value>,
) -> ApiResult<Json<Value>> {
    let id = request_id(&id)?;
    let n = shared.admin.requeue_dead(&id).await?;
    tracing::info!(peer = %who, action = "requeue dead letters", request = %id, requeued = n, "dashboard action");
    Ok(Json(json!({ "id": id.as_str(), "requeued": n })))
}

#[derive(Deserialize)]
struct PriorityBody {
    priority: Option<i64>,
}

async fn reprioritize(
    State(shared): State<Arc<Shared>>,
    who: Who,
    Path(id): Path<String>,
    Json(body): Json<PriorityBody>,
) -> ApiResult<Json<sluicegate::Reprioritized>> {
    let id = request_id(&id)?;
    let to = priority(
        body.priority
            .ok_or_else(|| ApiError::bad("the body must name the new priority: {\"priority\": 0 to 99}"))?,
    )?;
    let done = shared.admin.reprioritize(&id, to).await?;
    tracing::info!(peer = %who, action = "reprioritize", request = %id, from = done.from, to = done.to, "dashboard action");
    Ok(Json(done))
}

async fn purge(
    State(shared): State<Arc<Shared>>,
    who: Who,
    Path(id): Path<String>,
    Json(_): Json<Value>,
) -> ApiResult<Json<Value>> {
    let id = request_id(&id)?;
    let purged = shared.admin.purge(&id).await?;
    if !purged {
        return Err(ApiError::new(StatusCode::NOT_FOUND, format!("no request with id \"{id}\" to purge")));
    }
    tracing::info!(peer = %who, action = "purge", request = %id, "dashboard action");
    Ok(Json(json!({ "id": id.as_str(), "purged": true })))
}

async fn pause(shared: State<Arc<Shared>>, who: Who, body: Json<PriorityBody>) -> ApiResult<Json<Value>> {
    pause_or_resume(shared, who, body, true).await
}

async fn resume(shared: State<Arc<Shared>>, who: Who, body: Json<PriorityBody>) -> ApiResult<Json<Value>> {
    pause_or_resume(shared, who, body, false).await
}

/// Pauses or resumes the namespace, or one priority; answers what is paused now.
async fn pause_or_resume(
    State(shared): State<Arc<Shared>>,
    who: Who,
    Json(body): Json<PriorityBody>,
    pause: bool,
) -> ApiResult<Json<Value>> {
    let p = body.priority.map(priority).transpose()?;
    if pause {
        shared.admin.pause(p).await?;
    } else {
        shared.admin.resume(p).await?;
    }
    let action = if pause { "pause" } else { "resume" };
    tracing::info!(peer = %who, action, priority = ?p.map(Priority::get), "dashboard action");
    Ok(Json(json!({ "paused": shared.admin.paused().await? })))
}
