//! The checker's hold on every Redis call and every handler run of the code under test.
//!
//! Each actor (a producer's submit, one token take of a slot, a recovery pass, an operator's
//! command) runs as its own task. Whenever it is about to call Redis ([`Gate::run`], reached
//! through `Store::call`) or its handler is about to run ([`Gate::handler`]), it parks and tells
//! the scheduler, which resumes exactly one parked thing at a time. So the interleaving of all
//! calls is the scheduler's choice, replayable from its seed, and so are the faults each call
//! meets. Events carry no actor id: only one actor runs at a time, so whatever parks next belongs
//! to the actor the scheduler resumed last.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};

/// What happens to one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub(crate) enum Fault {
    /// It runs and its caller gets the reply.
    None,
    /// It runs, and its caller gets a connection error instead of the reply.
    LoseReply,
    /// It runs twice (fred re-sends in-flight commands after a reconnect); the caller gets the
    /// second reply.
    Resend,
    /// It runs, and its caller dies before it sees the reply.
    DieAfter,
    /// It does not run, and its caller gets an error that is not the connection's.
    Refuse,
    /// It does not run: fred had no connection to write it to (it was reconnecting after a cut)
    /// and gave up with `Failed to route command.`, which its caller may re-send.
    Unrouted,
}

/// How one handler run ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub(crate) enum Verdict {
    /// Returns the part's output.
    Ok,
    /// A retryable failure.
    Fail,
    /// A permanent failure.
    Permanent,
}

/// What a parked actor is waiting for.
pub(crate) enum Event {
    /// About to make a call: `what` (a function or command name) on `key`.
    Call { what: String, key: String, resume: oneshot::Sender<Fault> },
    /// The call of a [`Fault::DieAfter`] has run; the actor is to be dropped.
    Dying,
    /// A handler is about to run sub-request `index` (attempt `attempt`) of request `request`.
    Handler { request: String, index: u64, attempt: u32, input: u64, resume: oneshot::Sender<Verdict> },
    /// Work the actor starts in a task of its own (a lane finish's release, `slot::release`): the
    /// scheduler makes it an actor of the same process once this one parks, and does not poll it
    /// before, so that every event still comes from the actor it resumed last.
    Apart(Pin<Box<dyn Future<Output = ()> + Send>>),
}

/// The scheduler's end: shared by every store and handler of one checker world.
pub(crate) struct Gate {
    events: mpsc::UnboundedSender<Event>,
    /// Parts per load call (the real chunk is 2,000 parts: the checker wants several chunks).
    pub(crate) load_chunk: usize,
    /// Whether the actor running now starts its work apart ([`Gate::apart`]) as a worker does, or
    /// runs it itself as a worker does once it has many such tasks running: the scheduler sets it
    /// before it resumes a slot's actor, from that take's `Op::Take::apart`.
    apart: AtomicBool,
    /// Whether the actor running now cuts its hold's first batch after its first part
    /// ([`Gate::cuts`]), set as `apart` is, from `Op::Take::cut`.
    cut: AtomicBool,
    /// Whether the actor running now asks for wide batches ([`Gate::batches`]), set as `apart`
    /// is, from `Op::Take::wide`.
    wide: AtomicBool,
    /// Whether the actor running now is a take while the worker's holds fill its slots
    /// ([`Gate::rooms`]), set as `apart` is, from `Op::Take::room`.
    room: AtomicBool,
}

/// How a slot's take was drawn (`Op::Take`): the gate holds it while that take's actor runs.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Drawn {
    pub(crate) apart: bool,
    pub(crate) cut: bool,
    pub(crate) wide: bool,
    pub(crate) room: bool,
}

/// A wide hold's batch size and quantum (parts): runs of up to four outcomes in one `ack`
/// (`Op::Take::wide`), where the checker's workers otherwise ask for two within three.
const WIDE: (u32, u32) = (4, 6);

impl Gate {
    pub(crate) fn new(load_chunk: usize) -> (Gate, mpsc::UnboundedReceiver<Event>) {
        let (events, rx) = mpsc::unbounded_channel();
        let (apart, cut, wide) = (AtomicBool::new(false), AtomicBool::new(false), AtomicBool::new(false));
        let room = AtomicBool::new(false);
        (Gate { events, load_chunk, apart, cut, wide, room }, rx)
    }

    /// Sets how the actor about to run was drawn: whether it starts its work apart, whether it
    /// cuts its first batch, and whether it asks for wide batches.
    pub(crate) fn set_drawn(&self, drawn: Drawn) {
        self.apart.store(drawn.apart, Ordering::Relaxed);
        self.cut.store(drawn.cut, Ordering::Relaxed);
        self.wide.store(drawn.wide, Ordering::Relaxed);
        self.room.store(drawn.room, Ordering::Relaxed);
    }

    /// Whether the running actor's take finds its worker's holds filling its slots
    /// (`worker::bound`).
    pub(crate) fn rooms(&self) -> bool {
        self.room.load(Ordering::Relaxed)
    }

    /// The running actor's batch size and quantum when it was drawn wide (`Op::Take::wide`).
    pub(crate) fn batches(&self) -> Option<(u32, u32)> {
        self.wide.load(Ordering::Relaxed).then_some(WIDE)
    }

    /// Whether the running actor's hold hands back what follows its first batch's first part, as
    /// one whose first part ran past its budget does (`slot::first_budget`).
    pub(crate) fn cuts(&self) -> bool {
        self.cut.load(Ordering::Relaxed)
    }

    /// Hands `work` to the scheduler to run as an actor of its own, if the running actor starts
    /// work apart; else gives it back, for the caller to run itself.
    pub(crate) fn apart<F>(&self, work: F) -> Option<F>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        if !self.apart.load(Ordering::Relaxed) {
            return Some(work);
        }
        let _ = self.events.send(Event::Apart(Box::pin(work)));
        None
    }

    /// Parks until the scheduler resumes this call, then runs it with the fault it chose. A call
    /// whose actor the scheduler drops never returns.
    pub(crate) async fn run<T, F, Fut>(&self, what: &str, key: &str, op: F) -> Result<T>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let (resume, decided) = oneshot::channel();
        let _ = self.events.send(Event::Call { what: what.to_owned(), key: key.to_owned(), resume });
        let Ok(fault) = decided.await else { return std::future::pending().await };
        match fault {
            Fault::None => op().await,
            Fault::LoseReply => {
                let _ = op().await;
                Err(Error::from(fred::error::Error::new(
                    fred::error::ErrorKind::IO,
                    "connection reset after the call ran (a fault injected by the checker)",
                )))
            }
            Fault::Resend => {
                let _ = op().await;
                op().await
            }
            Fault::Refuse => Err(Error::from(fred::error::Error::new(
                fred::error::ErrorKind::Unknown,
                "OOM command not allowed when used memory > 'maxmemory' (a fault injected by the checker)",
            ))),
            Fault::Unrouted => Err(Error::from(fred::error::Error::new(
                fred::error::ErrorKind::Unknown,
                "Failed to route command. (a fault injected by the checker)",
            ))),
            Fault::DieAfter => {
                let _ = op().await;
                let _ = self.events.send(Event::Dying);
                std::future::pending().await
            }
        }
    }

    /// Parks a handler run until the scheduler says how it ends.
    pub(crate) async fn handler(&self, request: String, index: u64, attempt: u32, input: u64) -> Verdict {
        let (resume, decided) = oneshot::channel();
        let _ = self.events.send(Event::Handler { request, index, attempt, input, resume });
        match decided.await {
            Ok(v) => v,
            // The scheduler dropped its actor: this run never ends.
            Err(_) => std::future::pending().await,
        }
    }
}
