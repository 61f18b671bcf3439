//! Quickstart: split a text into chunks, transform them on workers, print the aggregated result.
//!
//! ```text
//! cargo run --example quickstart                 # built-in text, Redis at REDIS_URL or 127.0.0.1:6379
//! cargo run --example quickstart -- FILE         # your own text file
//! ```
//! The workers run in this process for the demo; in production they run anywhere that reaches the
//! same Redis, started with `Worker::builder(..).build().await?.run().await`.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sluicegate::{async_trait, Config, Context, Handler, HandlerError, Producer, Worker};

/// One sub-request: a chunk of lines.
#[derive(Serialize, Deserialize)]
struct Chunk {
    lines: Vec<String>,
}

/// One result: the transformed chunk and a word count.
#[derive(Serialize, Deserialize, Debug)]
struct Transformed {
    text: String,
    words: usize,
}

/// The work: upper-case every line and count its words.
struct Shout;

#[async_trait]
impl Handler for Shout {
    type Input = Chunk;
    type Output = Transformed;

    async fn handle(&self, ctx: Context, chunk: Chunk) -> Result<Transformed, HandlerError> {
        tracing::debug!(request = %ctx.request_id(), index = ctx.index(), "transforming a chunk");
        let words = chunk.lines.iter().map(|l| l.split_whitespace().count()).sum();
        Ok(Transformed { text: chunk.lines.join("\n").to_uppercase(), words })
    }
}

const BUILT_IN: &str = "\
Redis streams hold every sub-request of a request.
Tokens in priority lists bound how many run at once.
A huge request cannot starve the small ones,
and urgent requests go first.
Workers take a token, run a part, ack, and give the token back.
When every part is done, the producer gets the results in order.";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let text = match std::env::args().nth(1) {
        Some(path) => std::fs::read_to_string(&path).map_err(|e| format!("cannot read {path}: {e}"))?,
        None => BUILT_IN.to_owned(),
    };
    let config = Config::from_env().namespace("quickstart").retention(Duration::from_secs(60));
    println!("Redis: {}", config.url());

    // Two workers with four slots each, as two machines would run them.
    let stop = tokio_util::sync::CancellationToken::new();
    let mut workers = Vec::new();
    for _ in 0..2 {
        let worker = Worker::builder(&config, Shout).slots(4).build().await?;
        let stop = stop.clone();
        workers.push(tokio::spawn(worker.run_until(async move { stop.cancelled().await })));
    }

    // Split into chunks of two lines; at most three chunks of this request run at once.
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let chunks = lines.chunks(2).map(|c| Chunk { lines: c.to_vec() });
    let started = Instant::now();
    let producer = Producer::connect(&config).await?;
    let handle = producer.request().priority(60)?.concurrency(3)?.submit(chunks).await?;
    println!("submitted request {}", handle.id());

    let done = handle.wait::<Transformed>().await?;
    let outputs = done.into_outputs()?;
    let words: usize = outputs.iter().map(|t| t.words).sum();
    for t in &outputs {
        println!("{}", t.text);
    }
    println!("{} chunks, {words} words, in {:?}", outputs.len(), started.elapsed());

    stop.cancel();
    for w in workers {
        w.await??;
    }
    Ok(())
}
