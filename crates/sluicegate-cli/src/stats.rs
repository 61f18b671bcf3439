//! `sluicegate stats --since DURATION`: the stats by stage of a window, per priority.

use std::time::Duration;

use sluicegate::{Admin, PriorityStages, StageHistogram, StageStats};

use crate::failure::Failure;
use crate::output::{elapsed, timestamp, Out};
use crate::Ctx;

/// The longest window the stats by stage are read for (what `Admin::stats_since` reads at most).
const LONGEST: Duration = Duration::from_secs(31 * 24 * 3600);

pub(crate) async fn since(ctx: &Ctx, since: Duration) -> Result<(), Failure> {
    if since.is_zero() || since > LONGEST {
        return Err(Failure::bad_input("--since must be more than 0s and at most 31 days"));
    }
    let admin = ctx.connecting(Admin::connect(&ctx.config)).await?;
    let stats = admin.stats_since(since).await?;
    let mut out = Out::new();
    if ctx.json {
        out.json(&stats)?;
    } else {
        for line in lines(&stats) {
            out.line(&line)?;
        }
    }
    out.flush()
}

/// The report, one priority after another (highest first).
fn lines(stats: &StageStats) -> Vec<String> {
    let mut lines = vec![format!(
        "window           {} to {} ({})",
        timestamp(stats.from_ms),
        timestamp(stats.to_ms),
        elapsed(stats.from_ms, stats.to_ms)
    )];
    if stats.priorities.is_empty() {
        lines.push("nothing counted in this window".into());
    }
    for p in &stats.priorities {
        lines.push(format!("priority {}", p.priority));
        for (name, n) in counts(p) {
            lines.push(format!("  {name:<15}{n:>9}  {}/s", rate(stats.per_second(n))));
        }
        for (name, h) in [("queue wait", &p.queue_wait), ("run time", &p.run_time), ("duration", &p.duration)]
        {
            lines.push(format!("  {name:<15}{}", percentiles(h)));
        }
    }
    lines
}

fn counts(p: &PriorityStages) -> [(&'static str, u64); 8] {
    [
        ("submitted", p.submitted),
        ("started", p.started),
        ("completed", p.completed),
        ("failed", p.failed),
        ("succeeded", p.succeeded),
        ("retried", p.retried),
        ("dead-lettered", p.dead_lettered),
        ("fenced", p.fenced),
    ]
}

/// A rate with three significant digits or so: `0.0139`, `1.25`, `1234`.
fn rate(per_second: f64) -> String {
    match per_second {
        0.0 => "0".into(),
        r if r < 0.01 => format!("{r:.4}"),
        r if r < 10.0 => format!("{r:.2}"),
        r if r < 100.0 => format!("{r:.1}"),
        r => format!("{r:.0}"),
    }
}

/// `p50 12.5ms  p95 40ms  p99 48ms  (12 samples)`, or `no samples`.
fn percentiles(h: &StageHistogram) -> String {
    let (Some(p50), Some(p95), Some(p99)) = (h.quantile(0.5), h.quantile(0.95), h.quantile(0.99)) else {
        return "no samples".into();
    };
    let n = h.count();
    let samples = if n == 1 { "1 sample".to_owned() } else { format!("{n} samples") };
    format!("p50 {}  p95 {}  p99 {}  ({samples})", time(p50), time(p95), time(p99))
}

/// A latency for a person: `0.8ms`, `12ms`, `1.25s`, `3m 2s`.
fn time(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1000.0;
    if ms < 10.0 {
        format!("{ms:.1}ms")
    } else if ms < 1000.0 {
        format!("{ms:.0}ms")
    } else {
        elapsed(0, d.as_millis() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_times_read_well() {
        assert_eq!(rate(0.0), "0");
        assert_eq!(rate(1.0 / 720.0), "0.0014");
        assert_eq!(rate(1.254), "1.25");
        assert_eq!(rate(12.34), "12.3");
        assert_eq!(rate(1234.4), "1234");
        assert_eq!(time(Duration::from_micros(800)), "0.8ms");
        assert_eq!(time(Duration::from_micros(12_400)), "12ms");
        assert_eq!(time(Duration::from_millis(1250)), "1.25s");
        assert_eq!(time(Duration::from_secs(182)), "3m 2s");
        assert_eq!(percentiles(&StageHistogram::default()), "no samples");
    }
}
