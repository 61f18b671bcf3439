//! The neighbourhood of a request among the requests it runs after and before (`RequestBuilder::after`):
//! its upstreams and theirs, its downstreams and theirs, a few hops each way, as nodes and edges
//! for the request page's graph. Built from [`Admin::status`] of each node (the only reading that
//! names a request's upstreams and downstreams), so it is bounded: at most [`MAX_DEPTH`] hops each
//! way and [`MAX_NODES`] nodes, read [`CONCURRENT_READS`] at a time.

use std::collections::{HashMap, HashSet};

use futures::stream::{self, StreamExt};
use serde::Serialize;
use sluicegate::{Admin, Error, RequestId, RequestStatus, STATUS_DOWNSTREAMS};

/// Hops followed each way, by default and at most.
pub(crate) const MAX_DEPTH: usize = 2;

/// Nodes in a graph, by default and at most (the request itself included).
pub(crate) const MAX_NODES: usize = 100;

/// Statuses read at once.
const CONCURRENT_READS: usize = 16;

/// A request's neighbourhood.
#[derive(Debug, Serialize)]
pub(crate) struct Graph {
    /// The request it is the neighbourhood of.
    id: String,
    /// Hops followed each way.
    depth: usize,
    /// The request first, then the others hop by hop.
    nodes: Vec<Node>,
    /// `from` runs before `to` (`to` was submitted after `from`), between nodes shown.
    edges: Vec<Edge>,
    /// Some neighbours within `depth` are not shown: past the node limit, or past the
    /// [`STATUS_DOWNSTREAMS`] a status lists.
    truncated: bool,
}

#[derive(Debug, Serialize)]
struct Node {
    id: String,
    /// Hops from the request: negative towards its upstreams, positive towards its downstreams.
    level: i64,
    /// Its state; `gone` when nothing of it is left (never submitted, or its retention ran out).
    state: String,
    found: bool,
    priority: Option<u8>,
    total: Option<u64>,
    done: Option<u64>,
    failed: Option<u64>,
    reason: Option<String>,
    /// How many upstreams and downstreams it has in all, shown or not (downstreams: as many as its
    /// status lists).
    upstreams: usize,
    downstreams: usize,
}

#[derive(Debug, Serialize)]
struct Edge {
    from: String,
    to: String,
    /// How `from` ended as `to` heard (null while `to` waits for it, or when `to` is gone).
    ended: Option<String>,
}

impl Node {
    fn new(id: &str, level: i64, status: Option<&RequestStatus>) -> Self {
        match status {
            Some(s) => Self {
                id: id.to_owned(),
                level,
                state: s.state.to_string(),
                found: true,
                priority: Some(s.priority),
                total: Some(s.total),
                done: Some(s.done),
                failed: Some(s.failed),
                reason: s.reason.clone(),
                upstreams: s.upstreams.len(),
                downstreams: s.downstreams.len(),
            },
            None => Self {
                id: id.to_owned(),
                level,
                state: "gone".to_owned(),
                found: false,
                priority: None,
                total: None,
                done: None,
                failed: None,
                reason: None,
                upstreams: 0,
                downstreams: 0,
            },
        }
    }
}

/// The neighbourhood of `root`, `depth` hops each way, at most `limit` nodes. An unknown `root`
/// is [`Error::UnknownRequest`]; an unknown neighbour is a `gone` node.
pub(crate) async fn neighbourhood(
    admin: &Admin,
    root: &RequestId,
    depth: usize,
    limit: usize,
) -> sluicegate::Result<Graph> {
    let root_status = admin.status(root).await?;
    let root_id = root.to_string();
    let mut nodes = vec![Node::new(&root_id, 0, Some(&root_status))];
    let mut statuses: HashMap<String, RequestStatus> = HashMap::from([(root_id.clone(), root_status)]);
    let mut seen: HashSet<String> = HashSet::from([root_id.clone()]);
    let mut truncated = false;
    let (mut up, mut down) = (vec![root_id.clone()], vec![root_id.clone()]);
    for hop in 1..=depth as i64 {
        let next_up = unseen(&seen, up.iter().flat_map(|id| statuses[id].upstreams.iter().map(|u| &u.id)));
        let next_down = unseen(&seen, down.iter().flat_map(|id| statuses[id].downstreams.iter()))
            .into_iter()
            .filter(|id| !next_up.contains(id))
            .collect::<Vec<_>>();
        truncated |= down.iter().any(|id| statuses[id].downstreams.len() >= STATUS_DOWNSTREAMS);
        // Both ways alike when the limit cuts: one from each side in turn.
        let room = limit.saturating_sub(nodes.len());
        let (mut take_up, mut take_down) = (0, 0);
        while take_up + take_down < room && (take_up < next_up.len() || take_down < next_down.len()) {
            if take_up < next_up.len() && (take_up <= take_down || take_down == next_down.len()) {
                take_up += 1;
            } else {
                take_down += 1;
            }
        }
        truncated |= take_up < next_up.len() || take_down < next_down.len();
        let picked: Vec<(String, i64)> = next_up
            .into_iter()
            .take(take_up)
            .map(|id| (id, -hop))
            .chain(next_down.into_iter().take(take_down).map(|id| (id, hop)))
            .collect();
        let read: Vec<(String, i64, sluicegate::Result<RequestStatus>)> = stream::iter(picked)
            .map(|(id, level)| async move {
                let status = match RequestId::new(id.as_str()) {
                    Ok(rid) => admin.status(&rid).await,
                    Err(e) => Err(e.into()),
                };
                (id, level, status)
            })
            .buffered(CONCURRENT_READS)
            .collect()
            .await;
        (up, down) = (Vec::new(), Vec::new());
        for (id, level, status) in read {
            seen.insert(id.clone());
            match status {
                Ok(status) => {
                    nodes.push(Node::new(&id, level, Some(&status)));
                    statuses.insert(id.clone(), status);
                    if level < 0 { &mut up } else { &mut down }.push(id);
                }
                // Its retention ran out (or it never was): shown, with nothing beyond it.
                Err(Error::UnknownRequest(_)) => nodes.push(Node::new(&id, level, None)),
                Err(e) => return Err(e),
            }
        }
    }
    Ok(Graph { id: root_id, depth, edges: edges(&nodes, &statuses), nodes, truncated })
}

/// The ids of `ids` not in `seen`, each once, in order.
fn unseen<'a>(seen: &HashSet<String>, ids: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut new = HashSet::new();
    ids.filter(|id| !seen.contains(*id) && new.insert(*id)).cloned().collect()
}

/// Every link between two nodes shown, once: from the downstream's side when it was read (it says
/// how the upstream ended), else from the upstream's.
fn edges(nodes: &[Node], statuses: &HashMap<String, RequestStatus>) -> Vec<Edge> {
    let shown: HashSet<&str> = nodes.iter().map(|n| n.id.as_str()).collect();
    let mut done: HashSet<(String, String)> = HashSet::new();
    let mut edges = Vec::new();
    for node in nodes {
        let Some(status) = statuses.get(&node.id) else { continue };
        for u in status.upstreams.iter().filter(|u| shown.contains(u.id.as_str())) {
            if done.insert((u.id.clone(), node.id.clone())) {
                edges.push(Edge { from: u.id.clone(), to: node.id.clone(), ended: u.ended.clone() });
            }
        }
    }
    for node in nodes {
        let Some(status) = statuses.get(&node.id) else { continue };
        for d in status.downstreams.iter().filter(|d| shown.contains(d.as_str())) {
            if done.insert((node.id.clone(), d.clone())) {
                edges.push(Edge { from: node.id.clone(), to: d.clone(), ended: None });
            }
        }
    }
    edges
}
