//! A TCP proxy for fault injection: clients connect to the proxy, the proxy forwards every byte to
//! the real server and back, and the test can break the path in between.
//!
//! - [`Proxy::cut_all`] drops every live connection at once: both sockets are closed, and bytes the
//!   proxy has read but not yet forwarded are lost. That is the fault the contract cares about: a
//!   reply (say, a BRPOP that already popped a token) that the server sent but the client never
//!   received.
//! - [`Proxy::stall`] stops forwarding in both directions for a while; connections stay open, so
//!   clients see a server that is slow, not one that is gone.
//! - [`Proxy::start_chaos`] does random cuts and stalls in the background until
//!   [`Proxy::stop_chaos`].
//!
//! New connections are accepted at all times (also while stalled: their bytes wait like the
//! others'), so a client that reconnects after a cut gets through.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// What the background chaos of [`Proxy::start_chaos`] does.
#[derive(Clone, Debug)]
pub struct ProxyChaos {
    /// Pause between two faults (from the end of a stall), drawn uniformly.
    pub every: RangeInclusive<Duration>,
    /// Probability that a fault is a cut (else a stall). 0.0 = stalls only.
    pub cut_share: f64,
    /// Length of one stall, drawn uniformly. Keep it below the lease minus a heartbeat, or a
    /// stalled worker legitimately loses its claim (the contract's limit holds only "as long as
    /// live workers renew their leases").
    pub stall: RangeInclusive<Duration>,
}

/// What the proxy did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Connections accepted.
    pub accepted: u64,
    /// Connections currently open.
    pub live: u64,
    /// `cut_all` calls (each may close many connections).
    pub cuts: u64,
    /// Connections closed by cuts.
    pub connections_cut: u64,
    /// `stall` calls.
    pub stalls: u64,
    /// Commands clients sent through the proxy (RESP arrays, as every client of this project
    /// sends them): what a component connected through it costs Redis in calls.
    pub commands: u64,
}

/// A running proxy on 127.0.0.1 and a port the OS picked. Dropping it stops accepting, ends the
/// chaos task and closes every connection.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
    chaos: Mutex<Option<(watch::Sender<bool>, JoinHandle<()>)>>,
}

struct Shared {
    upstream: SocketAddr,
    /// Bumped by every cut; each connection task ends when it sees a change.
    cut: watch::Sender<u64>,
    /// Forwarding waits while `Some(t)` lies in the future.
    stalled_until: watch::Sender<Option<Instant>>,
    accepted: AtomicU64,
    live: AtomicU64,
    cuts: AtomicU64,
    connections_cut: AtomicU64,
    stalls: AtomicU64,
    commands: Arc<AtomicU64>,
}

impl Proxy {
    /// Listens on 127.0.0.1 (a free port) and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            cut: watch::Sender::new(0),
            stalled_until: watch::Sender::new(None),
            accepted: AtomicU64::new(0),
            live: AtomicU64::new(0),
            cuts: AtomicU64::new(0),
            connections_cut: AtomicU64::new(0),
            stalls: AtomicU64::new(0),
            commands: Arc::new(AtomicU64::new(0)),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Self { addr, shared, accept, chaos: Mutex::new(None) })
    }

    /// The address clients should connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `redis://<addr>`.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Closes every live connection now. Bytes in flight through the proxy are lost.
    pub fn cut_all(&self) {
        self.shared.cut_all();
    }

    /// Stops forwarding bytes, both ways and on every connection, for `d` from now (a stall in
    /// progress is extended if this one ends later).
    pub fn stall(&self, d: Duration) {
        self.shared.stall(d);
    }

    /// Starts random cuts and stalls in the background (replacing a chaos already running).
    pub fn start_chaos(&self, plan: ProxyChaos) {
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let shared = self.shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let cut = rand::thread_rng().gen_bool(plan.cut_share.clamp(0.0, 1.0));
                // The pause runs from the end of a stall: stalls never chain into one longer
                // than `plan.stall` allows, and bytes flow between two of them.
                let mut pause = random_duration(&plan.every);
                if !cut {
                    let stall = random_duration(&plan.stall);
                    pause += stall;
                    shared.stall(stall);
                }
                tokio::select! {
                    _ = stop_rx.changed() => return,
                    () = tokio::time::sleep(pause) => {}
                }
                if cut {
                    shared.cut_all();
                }
            }
        });
        if let Some((stop, old)) = self.chaos.lock().unwrap().replace((stop_tx, task)) {
            let _ = stop.send(true);
            old.abort();
        }
    }

    /// Stops the background chaos; a stall in progress runs to its end.
    pub async fn stop_chaos(&self) {
        let running = self.chaos.lock().unwrap().take();
        if let Some((stop, task)) = running {
            let _ = stop.send(true);
            let _ = task.await;
        }
    }

    /// Waits until no stall is in progress.
    pub async fn wait_unstalled(&self) {
        wait_unstalled(&mut self.shared.stalled_until.subscribe()).await;
    }

    /// Counters of what happened so far.
    pub fn stats(&self) -> ProxyStats {
        let s = &self.shared;
        ProxyStats {
            accepted: s.accepted.load(Ordering::Relaxed),
            live: s.live.load(Ordering::Relaxed),
            cuts: s.cuts.load(Ordering::Relaxed),
            connections_cut: s.connections_cut.load(Ordering::Relaxed),
            stalls: s.stalls.load(Ordering::Relaxed),
            commands: s.commands.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        if let Some((_, task)) = self.chaos.lock().unwrap().take() {
            task.abort();
        }
        // Ends every connection task, which closes its sockets.
        self.shared.cut.send_modify(|generation| *generation += 1);
    }
}

impl Shared {
    fn cut_all(&self) {
        self.cuts.fetch_add(1, Ordering::Relaxed);
        self.cut.send_modify(|generation| *generation += 1);
    }

    fn stall(&self, d: Duration) {
        self.stalls.fetch_add(1, Ordering::Relaxed);
        let until = Instant::now() + d;
        self.stalled_until.send_modify(|current| match current {
            Some(t) if *t >= until => {}
            _ => *current = Some(until),
        });
    }
}

fn random_duration(range: &RangeInclusive<Duration>) -> Duration {
    if range.start() >= range.end() {
        return *range.start();
    }
    rand::thread_rng().gen_range(range.clone())
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // Out of file descriptors and the like: back off rather than spin.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(serve(client, shared.clone()));
    }
}

/// Forwards one connection until either side closes it or a cut ends it.
async fn serve(client: TcpStream, shared: Arc<Shared>) {
    // Subscribed before anything else, so a cut from now on ends this connection.
    let mut cut = shared.cut.subscribe();
    cut.borrow_and_update();
    let Ok(upstream) = TcpStream::connect(shared.upstream).await else {
        // The server is down: the client sees its connection close, as it would without a proxy.
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    shared.live.fetch_add(1, Ordering::Relaxed);
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    let counter = Some(Commands::new(shared.commands.clone()));
    let to_server = pump(client_read, upstream_write, shared.stalled_until.subscribe(), counter);
    let to_client = pump(upstream_read, client_write, shared.stalled_until.subscribe(), None);
    tokio::select! {
        _ = to_server => {}
        _ = to_client => {}
        _ = cut.changed() => { shared.connections_cut.fetch_add(1, Ordering::Relaxed); }
    }
    shared.live.fetch_sub(1, Ordering::Relaxed);
    // Returning drops all four halves: both sockets close.
}

/// Copies bytes one way, holding each chunk back while a stall is on; counts the commands in them
/// when given a counter.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut stalled_until: watch::Receiver<Option<Instant>>,
    mut commands: Option<Commands>,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        if let Some(commands) = &mut commands {
            commands.feed(&buf[..n]);
        }
        wait_unstalled(&mut stalled_until).await;
        to.write_all(&buf[..n]).await?;
    }
}

/// Returns once no stall is in progress (a stall extended meanwhile is waited out too).
async fn wait_unstalled(stalled_until: &mut watch::Receiver<Option<Instant>>) {
    loop {
        let until = *stalled_until.borrow_and_update();
        match until {
            Some(t) if t > Instant::now() => {
                tokio::select! {
                    () = tokio::time::sleep_until(t) => {}
                    _ = stalled_until.changed() => {}
                }
            }
            _ => return,
        }
    }
}

/// Counts the commands in a client's byte stream: RESP arrays of bulk strings (`*<n>\r\n` then
/// n times `$<len>\r\n<len bytes>\r\n`), however the reads cut them.
struct Commands {
    total: Arc<AtomicU64>,
    /// The header line read so far (`*<n>` or `$<len>`).
    line: Vec<u8>,
    /// Bulk strings of the current command still to come.
    args_left: u64,
    /// Bytes of the current bulk string (and its `\r\n`) still to skip.
    skip: u64,
}

impl Commands {
    fn new(total: Arc<AtomicU64>) -> Self {
        Self { total, line: Vec::new(), args_left: 0, skip: 0 }
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.skip > 0 {
                let n = (self.skip as usize).min(bytes.len());
                self.skip -= n as u64;
                bytes = &bytes[n..];
                if self.skip == 0 && self.args_left == 0 {
                    self.total.fetch_add(1, Ordering::Relaxed);
                }
                continue;
            }
            let Some(end) = bytes.iter().position(|&b| b == b'\n') else {
                self.line.extend_from_slice(bytes);
                return;
            };
            self.line.extend_from_slice(&bytes[..end]);
            bytes = &bytes[end + 1..];
            let line = std::mem::take(&mut self.line);
            let line = line.strip_suffix(b"\r").unwrap_or(&line);
            let number = || std::str::from_utf8(&line[1..]).ok().and_then(|n| n.parse::<u64>().ok());
            match line.first() {
                Some(b'*') if self.args_left == 0 => match number() {
                    Some(0) | None => self.total.fetch_add(1, Ordering::Relaxed),
                    Some(n) => {
                        self.args_left = n;
                        0
                    }
                },
                Some(b'$') if self.args_left > 0 => {
                    self.args_left -= 1;
                    self.skip = number().unwrap_or(0) + 2;
                    0
                }
                // An inline command (a line of text) is one command too.
                _ => self.total.fetch_add(1, Ordering::Relaxed),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_counted_however_the_reads_cut_them() {
        let stream =
            b"*2\r\n$3\r\nGET\r\n$1\r\na\r\n*3\r\n$3\r\nSET\r\n$1\r\nb\r\n$5\r\nx\r\ny\n\r\nPING\r\n";
        for cut in 1..stream.len() {
            let total = Arc::new(AtomicU64::new(0));
            let mut commands = Commands::new(total.clone());
            for chunk in stream.chunks(cut) {
                commands.feed(chunk);
            }
            assert_eq!(total.load(Ordering::Relaxed), 3, "reads of {cut} bytes");
        }
    }
}
