//! Several parts to a sub-request: [`chunks`] on the producer's side, [`Chunked`] on the
//! worker's.
//!
//! A sub-request costs Redis about the same whatever it carries: its stream entry, its delivery,
//! its ack and its result are each a fixed amount of work. When a request's parts are tiny and
//! quick (a few bytes each, handlers that take microseconds), that fixed work is most of what the
//! request costs, and packing several parts into one sub-request divides it among them
//! (docs/benchmarks.md, "Chunks": 2.4 to 2.8 times less Redis CPU per part with six to a
//! sub-request). What a chunk gives up is the sub-request's independence: a chunk runs, retries,
//! times out and is dead-lettered as one, and its result is the list of its parts' outputs.
//! Handlers run again on a retry of their chunk even when their own part had succeeded, which
//! at-least-once delivery allows already ([`Context::idempotency_key`] stays per part).
//! Whatever counts sub-requests counts chunks: the concurrency limit, a group's rate, the quantum,
//! a request's `total` and `failed`, the attempt timeout (it covers the whole chunk: scale it by
//! the chunk's size), and [`Context::upstream`]'s ranges when the upstream was sent in chunks
//! (range `i..i + 1` is chunk `i`).
//!
//! ```no_run
//! # async fn demo() -> sluicegate::Result<()> {
//! use sluicegate::{chunks, Config, Producer};
//! let producer = Producer::connect(&Config::from_env()).await?;
//! let words = (0..1_000).map(|i| format!("word {i}"));
//! let handle = producer.request().concurrency(4)?.submit(chunks(words, 8)?).await?;
//! // One result per chunk, each the outputs of its parts in order.
//! let outputs = handle.wait::<Vec<String>>().await?.into_outputs();
//! let upper: Vec<String> = outputs.expect("no chunk failed").into_iter().flatten().collect();
//! # Ok(()) }
//! ```
//!
//! The worker wraps its handler, which still runs one part at a time:
//! `Worker::builder(&config, Chunked(Upper))`. A chunk's payload is the MessagePack array
//! `[first, [part, ...]]`, where `first` is the index of its first part in the request (what a
//! producer or worker in another language writes and reads), and its result the array of its
//! parts' outputs.

use std::panic::AssertUnwindSafe;

use async_trait::async_trait;
use futures::FutureExt;
use serde::{Deserialize, Serialize};

use crate::request::InvalidValue;
use crate::worker::{panic_text, Context, Handler, HandlerError};

/// The most parts one chunk may hold.
pub const MAX_CHUNK: usize = 10_000;

/// Parts `first..first + parts.len()` of a request, sent as one sub-request (see [`chunks`]).
/// Encoded as the MessagePack array `[first, [part, ...]]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk<T>(pub u64, pub Vec<T>);

impl<T> Chunk<T> {
    /// The index in the request of the chunk's first part.
    pub fn first(&self) -> u64 {
        self.0
    }

    /// The chunk's parts, in order.
    pub fn parts(&self) -> &[T] {
        &self.1
    }
}

/// Groups `parts` into chunks of `size` (the last may hold fewer), one sub-request each, for a
/// worker that runs [`Chunked`]. `size` is from 1 to [`MAX_CHUNK`]. The first part is part 0 of
/// the request; for the later `add`s of a streamed request, [`Chunks::from_part`] says which.
pub fn chunks<I: IntoIterator>(parts: I, size: usize) -> Result<Chunks<I::IntoIter>, InvalidValue> {
    if size == 0 || size > MAX_CHUNK {
        return Err(InvalidValue::Request(format!("a chunk holds from 1 to {MAX_CHUNK} parts, not {size}")));
    }
    Ok(Chunks { parts: parts.into_iter(), size, next: 0 })
}

/// The iterator [`chunks`] returns.
#[derive(Debug)]
pub struct Chunks<I> {
    parts: I,
    size: usize,
    next: u64,
}

impl<I> Chunks<I> {
    /// Numbers the parts from `first` rather than 0: a streamed request's `add` of chunks after
    /// `first` parts were added in chunks before (`chunks(more, 8)?.from_part(sent)`), so that
    /// each part's [`Context::index`] is its place in the whole request.
    pub fn from_part(mut self, first: u64) -> Self {
        self.next = first;
        self
    }
}

impl<I: Iterator> Iterator for Chunks<I> {
    type Item = Chunk<I::Item>;

    fn next(&mut self) -> Option<Self::Item> {
        let parts: Vec<I::Item> = self.parts.by_ref().take(self.size).collect();
        if parts.is_empty() {
            return None;
        }
        let first = self.next;
        self.next += parts.len() as u64;
        Some(Chunk(first, parts))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let (low, high) = self.parts.size_hint();
        (low.div_ceil(self.size), high.map(|h| h.div_ceil(self.size)))
    }
}

/// Runs the chunks of [`chunks`] with a handler of single parts: each part in turn, in order,
/// with a [`Context`] whose [`index`](Context::index) (and so
/// [`idempotency_key`](Context::idempotency_key)) is the part's own. The chunk's output is its
/// parts' outputs; its first failure ends it (the parts after it do not run) and is the chunk's,
/// permanent or not as the part's was (a panic is retryable), its message prefixed with the
/// part's index. A chunk whose hold is lost, or whose run is cancelled, stops before its next
/// part.
#[derive(Clone, Debug, Default)]
pub struct Chunked<H>(pub H);

#[async_trait]
impl<H: Handler> Handler for Chunked<H> {
    type Input = Chunk<H::Input>;
    type Output = Vec<H::Output>;

    async fn handle(&self, ctx: Context, chunk: Chunk<H::Input>) -> Result<Vec<H::Output>, HandlerError> {
        let Chunk(first, parts) = chunk;
        let mut outputs = Vec::with_capacity(parts.len());
        for (index, part) in (first..).zip(parts) {
            if ctx.cancelled().is_cancelled() {
                return Err(HandlerError::new(format!("part {index}: the chunk's run was cancelled")));
            }
            let mut part_ctx = ctx.clone();
            part_ctx.index = index;
            // A panic is the part's failure too, named like the others (the worker would record
            // it as the chunk's, without the part).
            match AssertUnwindSafe(self.0.handle(part_ctx, part)).catch_unwind().await {
                Ok(Ok(output)) => outputs.push(output),
                Err(panic) => {
                    let text = panic_text(&*panic);
                    return Err(HandlerError::new(format!("part {index}: handler panicked: {text}")));
                }
                Ok(Err(e)) => {
                    let message = format!("part {index}: {}", e.message());
                    return Err(if e.is_permanent() {
                        HandlerError::permanent(message)
                    } else {
                        HandlerError::new(message)
                    });
                }
            }
        }
        Ok(outputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_number_their_first_parts_and_keep_every_part_in_order() {
        let got: Vec<Chunk<u32>> = chunks(0..10, 4).unwrap().collect();
        assert_eq!(got, vec![Chunk(0, vec![0, 1, 2, 3]), Chunk(4, vec![4, 5, 6, 7]), Chunk(8, vec![8, 9])]);
        assert_eq!(chunks(0..10, 4).unwrap().size_hint(), (3, Some(3)));
        assert_eq!(chunks(0..0, 4).unwrap().count(), 0);
        assert_eq!(chunks(0..3, 1).unwrap().count(), 3);
        let later: Vec<Chunk<u32>> = chunks(10..13, 2).unwrap().from_part(10).collect();
        assert_eq!(later, vec![Chunk(10, vec![10, 11]), Chunk(12, vec![12])]);
    }

    #[test]
    fn a_chunk_size_out_of_range_names_the_bounds() {
        for size in [0, MAX_CHUNK + 1] {
            let err = chunks(0..3, size).unwrap_err();
            assert!(err.to_string().contains(&format!("from 1 to {MAX_CHUNK} parts, not {size}")), "{err}");
        }
    }

    #[test]
    fn a_chunk_is_the_array_of_its_first_index_and_its_parts() {
        let bytes = crate::codec::encode(&Chunk(7, vec!["a".to_owned(), "b".to_owned()])).unwrap();
        // fixarray(2), 7, fixarray(2), "a", "b"
        assert_eq!(bytes, vec![0x92, 0x07, 0x92, 0xa1, b'a', 0xa1, b'b']);
        let back: Chunk<String> = crate::codec::decode(&bytes).unwrap();
        assert_eq!(back, Chunk(7, vec!["a".to_owned(), "b".to_owned()]));
    }
}
