//! What a schedule is: its name, its cron pattern and time zone, what it does about missed ticks,
//! and the request it submits at each tick; and how that is stored (JSON, docs/protocol.md §3).

use std::time::Duration;

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use super::cron::Cron;
use crate::codec;
use crate::config::millis;
use crate::error::{Error, Result};
use crate::producer::RequestBuilder;
use crate::protocol::lane;
use crate::request::{check_tag, Concurrency, Priority, MAX_TAGS, MAX_TAG_BYTES};

/// The most ticks a schedule catches up on ([`Missed::CatchUp`]).
pub const MAX_CATCH_UP: u32 = 100;

/// The most bytes a schedule's spec takes in Redis (its parts count, base64-encoded).
pub const MAX_SPEC_BYTES: usize = 1 << 20;

/// The prefix of the tag every request of a schedule carries: `schedule:<name>`.
const TAG_PREFIX: &str = "schedule:";

/// The longest schedule name: its requests' tag, `schedule:<name>`, is a tag.
pub const MAX_SCHEDULE_NAME_BYTES: usize = MAX_TAG_BYTES - TAG_PREFIX.len();

/// What a schedule does about ticks that fell due while no worker fired it (none ran, or all
/// were busy or cut off). Ticks that fall while it is paused are never owed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Missed {
    /// Only the latest due tick is submitted (the default).
    Skip,
    /// The last `n` due ticks are submitted, oldest first (1 to [`MAX_CATCH_UP`]).
    CatchUp(u32),
}

impl std::fmt::Display for Missed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Missed::Skip => f.write_str("skip"),
            Missed::CatchUp(n) => write!(f, "catch-up {n}"),
        }
    }
}

impl Serialize for Missed {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl Missed {
    /// How many of the due ticks a firing owes.
    pub(crate) fn keep(self) -> usize {
        match self {
            Missed::Skip => 1,
            Missed::CatchUp(n) => n as usize,
        }
    }
}

/// A schedule to add with `Admin::schedule_add`: a cron pattern,
/// and the request each of its ticks submits, described as for
/// [`Producer::request`](crate::Producer::request). Each tick `T` (ms since the Unix epoch)
/// submits request `<name>@<T>`, tagged `schedule:<name>` (unless unlisted).
///
/// ```
/// use sluicegate::{Missed, ScheduleSpec};
/// let spec = ScheduleSpec::new("nightly-report", "30 2 * * *")?
///     .time_zone("Europe/Rome")?
///     .missed(Missed::CatchUp(3))?
///     .parts(["sales", "stock"])?
///     .priority(70)?
///     .concurrency(2)?;
/// assert_eq!(spec.name(), "nightly-report");
/// # Ok::<(), sluicegate::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduleSpec {
    name: String,
    stored: Stored,
}

/// The spec as stored in the schedules hash (JSON). Every field has a default, so that a spec
/// written by a later version with more fields, or by another client, reads back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Stored {
    cron: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tz: Option<String>,
    /// `skip` or `catch-up` (anything else reads as `skip`).
    #[serde(default = "skip")]
    missed: String,
    /// With `catch-up`: how many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    catch_up: Option<u32>,
    #[serde(default)]
    request: Template,
}

fn skip() -> String {
    "skip".into()
}

impl Stored {
    fn missed(&self) -> Missed {
        match (self.missed.as_str(), self.catch_up) {
            ("catch-up", Some(n)) => Missed::CatchUp(n.clamp(1, MAX_CATCH_UP)),
            _ => Missed::Skip,
        }
    }
}

/// The request a tick submits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
struct Template {
    /// Each part's MessagePack, base64 (standard alphabet, padded).
    parts: Vec<String>,
    priority: u8,
    limit: u32,
    max_attempts: u32,
    backoff_ms: u64,
    backoff_max_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    timeout_ms: Option<u64>,
    delay_ms: u64,
    tags: Vec<String>,
    fail_fast: bool,
    own_stream: bool,
    unlisted: bool,
    /// Written only when set, so that a spec stored before the field existed reads back equal.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    discard_results: bool,
}

impl Default for Template {
    fn default() -> Self {
        Self {
            parts: Vec::new(),
            priority: Priority::DEFAULT.get(),
            limit: 1,
            max_attempts: 1,
            backoff_ms: 1_000,
            backoff_max_ms: 60_000,
            timeout_ms: None,
            delay_ms: 0,
            tags: Vec::new(),
            fail_fast: false,
            own_stream: false,
            unlisted: false,
            discard_results: false,
        }
    }
}

/// Checks a schedule name: 1 to [`MAX_SCHEDULE_NAME_BYTES`] characters of `A-Z a-z 0-9` and
/// `_ . : / = + -` (a tag's, without `@`, which separates the name from the tick in its
/// requests' ids).
/// ```
/// use sluicegate::check_schedule_name;
/// assert!(check_schedule_name("nightly-report").is_ok());
/// assert!(check_schedule_name("a@b").is_err());
/// ```
pub fn check_schedule_name(name: &str) -> Result<()> {
    let allowed = |b: u8| b.is_ascii_alphanumeric() || b"_.:/=+-".contains(&b);
    if name.is_empty() || name.len() > MAX_SCHEDULE_NAME_BYTES || !name.bytes().all(allowed) {
        return Err(Error::InvalidSchedule(format!(
            "invalid schedule name {name:?}: a name is 1 to {MAX_SCHEDULE_NAME_BYTES} characters of A-Z a-z 0-9 _ . : / = + - \
             (not @, which separates a schedule's name from the tick in its requests' ids)"
        )));
    }
    Ok(())
}

fn invalid(what: String) -> Error {
    Error::InvalidSchedule(what)
}

impl ScheduleSpec {
    /// A schedule `name` (see [`check_schedule_name`]) that ticks by the cron `pattern`: five
    /// fields (minute hour day-of-month month day-of-week), or six with seconds first, or a
    /// nickname (`@hourly`, `@daily`, ...), in UTC unless [`time_zone`](Self::time_zone) says
    /// otherwise. Its request has no parts until [`parts`](Self::parts) gives them.
    pub fn new(name: impl Into<String>, pattern: impl Into<String>) -> Result<Self> {
        let (name, cron) = (name.into(), pattern.into());
        check_schedule_name(&name)?;
        Cron::parse(&cron, None).map_err(invalid)?;
        let stored = Stored { cron, tz: None, missed: skip(), catch_up: None, request: Template::default() };
        Ok(Self { name, stored })
    }

    /// The pattern's times are in this time zone (an IANA name: `Europe/Rome`); its changes of
    /// the clocks follow the time zone database compiled in (docs/operations.md, "Schedules").
    pub fn time_zone(mut self, tz: impl Into<String>) -> Result<Self> {
        let tz = tz.into();
        Cron::parse(&self.stored.cron, Some(&tz)).map_err(invalid)?;
        self.stored.tz = Some(tz);
        Ok(self)
    }

    /// What to do about ticks missed while no worker fired the schedule (default
    /// [`Missed::Skip`]).
    pub fn missed(mut self, missed: Missed) -> Result<Self> {
        if let Missed::CatchUp(n) = missed {
            if !(1..=MAX_CATCH_UP).contains(&n) {
                return Err(invalid(format!("catch-up {n} is out of range: use 1 to {MAX_CATCH_UP}")));
            }
        }
        (self.stored.missed, self.stored.catch_up) = match missed {
            Missed::Skip => (skip(), None),
            Missed::CatchUp(n) => ("catch-up".into(), Some(n)),
        };
        Ok(self)
    }

    /// The request's parts, encoded as MessagePack as [`RequestBuilder::submit`] encodes them.
    pub fn parts<I, T>(mut self, parts: I) -> Result<Self>
    where
        I: IntoIterator<Item = T>,
        T: Serialize,
    {
        let b64 = base64::engine::general_purpose::STANDARD;
        self.stored.request.parts =
            parts.into_iter().map(|p| codec::encode(&p).map(|b| b64.encode(b))).collect::<Result<_>>()?;
        Ok(self)
    }

    /// Parts already encoded as MessagePack (the CLI's, say).
    pub fn encoded_parts<I: IntoIterator<Item = Vec<u8>>>(mut self, parts: I) -> Self {
        let b64 = base64::engine::general_purpose::STANDARD;
        self.stored.request.parts = parts.into_iter().map(|p| b64.encode(p)).collect();
        self
    }

    /// The request's priority, 0 to 99 (default 50): [`RequestBuilder::priority`].
    pub fn priority(mut self, p: u8) -> Result<Self> {
        self.stored.request.priority = Priority::new(p)?.get();
        Ok(self)
    }

    /// The request's concurrency limit (default 1): [`RequestBuilder::concurrency`].
    pub fn concurrency(mut self, n: u32) -> Result<Self> {
        self.stored.request.limit = Concurrency::new(n)?.get();
        Ok(self)
    }

    /// Attempts per part (default 1): [`RequestBuilder::max_attempts`].
    pub fn max_attempts(mut self, n: u32) -> Result<Self> {
        self.stored.request.max_attempts = n;
        self.checked()
    }

    /// Retry delays (default 1 s doubling to 60 s): [`RequestBuilder::backoff`].
    pub fn backoff(mut self, base: Duration, max: Duration) -> Result<Self> {
        self.stored.request.backoff_ms = millis(base);
        self.stored.request.backoff_max_ms = millis(max);
        self.checked()
    }

    /// Each attempt's time limit: [`RequestBuilder::timeout`].
    pub fn timeout(mut self, limit: Duration) -> Result<Self> {
        self.stored.request.timeout_ms = Some(millis(limit));
        self.checked()
    }

    /// Each tick's request becomes eligible this long after its tick: [`RequestBuilder::delay`].
    pub fn delay(mut self, delay: Duration) -> Self {
        self.stored.request.delay_ms = millis(delay);
        self
    }

    /// A tag besides `schedule:<name>`: [`RequestBuilder::tag`].
    pub fn tag(mut self, tag: impl Into<String>) -> Result<Self> {
        let tag = tag.into();
        check_tag(&tag)?;
        if !self.stored.request.tags.contains(&tag) {
            if self.stored.request.tags.len() + 1 >= MAX_TAGS {
                return Err(invalid(format!(
                    "a schedule's request carries at most {} tags besides its schedule:<name>",
                    MAX_TAGS - 1
                )));
            }
            self.stored.request.tags.push(tag);
        }
        Ok(self)
    }

    /// [`RequestBuilder::fail_fast`].
    pub fn fail_fast(mut self, on: bool) -> Self {
        self.stored.request.fail_fast = on;
        self
    }

    /// [`RequestBuilder::own_stream`].
    pub fn own_stream(mut self, on: bool) -> Self {
        self.stored.request.own_stream = on;
        self
    }

    /// [`RequestBuilder::unlisted`]: the requests are left out of the listing index, and carry
    /// no tag (not even `schedule:<name>`).
    pub fn unlisted(mut self) -> Self {
        self.stored.request.unlisted = true;
        self
    }

    /// [`RequestBuilder::discard_results`]: each tick's request stores no result of a part that
    /// succeeds (its errors are kept), and a `wait()` on it returns its counts alone.
    pub fn discard_results(mut self, on: bool) -> Self {
        self.stored.request.discard_results = on;
        self
    }

    /// Whether each tick's request discards its results.
    pub fn discards_results(&self) -> bool {
        self.stored.request.discard_results
    }

    /// The schedule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its cron pattern.
    pub fn pattern(&self) -> &str {
        &self.stored.cron
    }

    /// Its time zone (`None`: UTC).
    pub fn zone(&self) -> Option<&str> {
        self.stored.tz.as_deref()
    }

    /// Its missed-ticks policy.
    pub fn missed_policy(&self) -> Missed {
        self.stored.missed()
    }

    /// How many parts each tick's request has.
    pub fn part_count(&self) -> usize {
        self.stored.request.parts.len()
    }

    /// Each tick's request's priority.
    pub fn request_priority(&self) -> u8 {
        self.stored.request.priority
    }

    /// Each tick's request's tags, `schedule:<name>` first (none when unlisted).
    pub fn request_tags(&self) -> Vec<String> {
        if self.stored.request.unlisted {
            return Vec::new();
        }
        let mut tags = vec![format!("{TAG_PREFIX}{}", self.name)];
        tags.extend(self.stored.request.tags.iter().cloned());
        tags
    }

    /// The id of the request of tick `tick` (ms).
    pub(crate) fn request_id(&self, tick: i64) -> String {
        format!("{}@{tick}", self.name)
    }

    /// The cron pattern, parsed in its time zone.
    pub(crate) fn cron(&self) -> Result<Cron> {
        Cron::parse(&self.stored.cron, self.stored.tz.as_deref()).map_err(invalid)
    }

    /// The stored form (JSON).
    pub(crate) fn to_json(&self) -> Result<String> {
        serde_json::to_string(&self.stored)
            .map_err(|e| Error::Codec(format!("cannot encode a schedule: {e}")))
    }

    /// A spec read back from Redis.
    pub(crate) fn from_json(name: &str, json: &str) -> Result<Self> {
        let stored: Stored = serde_json::from_str(json).map_err(|e| {
            Error::Protocol(format!("schedule {name:?} has a spec this version cannot read: {e}"))
        })?;
        Ok(Self { name: name.to_owned(), stored })
    }

    /// The checks that need the whole spec: what a submit would refuse, and the size.
    fn checked(self) -> Result<Self> {
        let r = &self.stored.request;
        if !(1..=1000).contains(&r.max_attempts) {
            return Err(invalid(format!("max_attempts {} is out of range: use 1 to 1000", r.max_attempts)));
        }
        if r.backoff_ms > r.backoff_max_ms {
            return Err(invalid(format!(
                "backoff base {} ms exceeds its cap {} ms",
                r.backoff_ms, r.backoff_max_ms
            )));
        }
        if r.timeout_ms == Some(0) {
            return Err(invalid("a timeout must be longer than zero".into()));
        }
        Ok(self)
    }

    /// Everything checked before the spec is stored: each tick's request must be one a producer
    /// accepts (the same rules: [`RequestBuilder`]'s setters, and what a submit refuses).
    pub(crate) fn validate(&self) -> Result<String> {
        let spec = self.clone().checked()?;
        let r = &spec.stored.request;
        if r.parts.is_empty() {
            return Err(invalid(format!(
                "schedule {:?} has no parts: a request needs at least one",
                self.name
            )));
        }
        if r.unlisted {
            let bytes: usize = r.parts.iter().map(|p| p.len() * 3 / 4).sum();
            if !r.tags.is_empty() {
                return Err(invalid("an unlisted schedule's requests cannot carry tags".into()));
            }
            if r.own_stream || r.delay_ms > 0 || r.parts.len() > lane::MAX_PARTS || bytes > lane::MAX_BYTES {
                return Err(invalid(format!(
                    "only a small request can be unlisted: at most {} parts and {} KB, not delayed, not own_stream",
                    lane::MAX_PARTS,
                    lane::MAX_BYTES >> 10
                )));
            }
        }
        let json = self.to_json()?;
        if json.len() > MAX_SPEC_BYTES {
            return Err(invalid(format!(
                "schedule {:?} takes {} bytes: at most {MAX_SPEC_BYTES} (its parts are stored with it)",
                self.name,
                json.len()
            )));
        }
        Ok(json)
    }

    /// Each tick's request as a producer submits it: `builder`, with the template's settings and
    /// the tick's id and tags. Returns it with the parts to submit.
    pub(crate) fn request<'a>(
        &self,
        builder: RequestBuilder<'a>,
        tick: i64,
    ) -> Result<(RequestBuilder<'a>, Vec<codec::Encoded>)> {
        let r = &self.stored.request;
        let mut b = builder
            .id(self.request_id(tick))?
            .priority(r.priority)?
            .concurrency(r.limit)?
            .max_attempts(r.max_attempts)?
            .backoff(Duration::from_millis(r.backoff_ms), Duration::from_millis(r.backoff_max_ms))?
            .fail_fast(r.fail_fast)
            .own_stream(r.own_stream)
            .discard_results(r.discard_results)
            .delay(Duration::from_millis(r.delay_ms));
        if let Some(t) = r.timeout_ms {
            b = b.timeout(Duration::from_millis(t))?;
        }
        if r.unlisted {
            b = b.unlisted();
        }
        for tag in self.request_tags() {
            b = b.tag(tag)?;
        }
        let b64 = base64::engine::general_purpose::STANDARD;
        let parts = r
            .parts
            .iter()
            .map(|p| {
                b64.decode(p).map(codec::Encoded).map_err(|e| {
                    Error::Protocol(format!("schedule {:?} has a part that is not base64: {e}", self.name))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((b, parts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_patterns_and_policies_are_checked_and_say_what_is_wrong() {
        for bad in ["", "a@b", "two words", &"x".repeat(MAX_SCHEDULE_NAME_BYTES + 1), "{tag}"] {
            let e = ScheduleSpec::new(bad, "* * * * *").unwrap_err();
            assert!(
                matches!(e, Error::InvalidSchedule(_)) && e.to_string().contains("invalid schedule name"),
                "{e}"
            );
        }
        assert!(ScheduleSpec::new("x".repeat(MAX_SCHEDULE_NAME_BYTES), "* * * * *").is_ok());
        let e = ScheduleSpec::new("ok", "61 * * * *").unwrap_err();
        assert!(e.to_string().contains("invalid cron"), "{e}");
        let spec = ScheduleSpec::new("ok", "* * * * *").unwrap();
        let e = spec.clone().time_zone("Europe/Atlantis").unwrap_err();
        assert!(e.to_string().contains("unknown time zone \"Europe/Atlantis\""), "{e}");
        for n in [0, MAX_CATCH_UP + 1] {
            let e = spec.clone().missed(Missed::CatchUp(n)).unwrap_err();
            assert!(e.to_string().contains(&format!("catch-up {n} is out of range")), "{e}");
        }
        let e = spec.clone().max_attempts(0).unwrap_err();
        assert!(e.to_string().contains("max_attempts 0"), "{e}");
        let e = spec.validate().unwrap_err();
        assert!(e.to_string().contains("has no parts"), "{e}");
        let e = spec.clone().parts([1]).unwrap().unlisted().tag("x").unwrap().validate().unwrap_err();
        assert!(e.to_string().contains("cannot carry tags"), "{e}");
        let e = spec.clone().parts([1]).unwrap().unlisted().own_stream(true).validate().unwrap_err();
        assert!(e.to_string().contains("only a small request can be unlisted"), "{e}");
        let huge = "x".repeat(MAX_SPEC_BYTES);
        let e = spec.clone().parts([huge]).unwrap().validate().unwrap_err();
        assert!(e.to_string().contains("at most 1048576"), "{e}");
    }

    #[test]
    fn the_stored_spec_reads_back_and_names_its_fields() {
        let spec = ScheduleSpec::new("s", "*/5 * * * *")
            .and_then(|s| s.time_zone("Europe/Rome"))
            .and_then(|s| s.missed(Missed::CatchUp(4)))
            .and_then(|s| s.parts(["a"]))
            .and_then(|s| s.tag("team:x"))
            .unwrap()
            .fail_fast(true);
        let json = spec.validate().unwrap();
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(value["cron"], "*/5 * * * *");
        assert_eq!(value["tz"], "Europe/Rome");
        assert_eq!((value["missed"].as_str(), value["catch_up"].as_u64()), (Some("catch-up"), Some(4)));
        assert_eq!(value["request"]["parts"][0], "oWE=");
        assert_eq!(value["request"]["tags"][0], "team:x");
        assert_eq!(ScheduleSpec::from_json("s", &json).unwrap(), spec);
        // Discarding is written only when set: a spec stored before it existed compares equal.
        assert!(value["request"].get("discard_results").is_none(), "{json}");
        let discarding = spec.clone().discard_results(true);
        let stored: serde_json::Value = serde_json::from_str(&discarding.validate().unwrap()).unwrap();
        assert_eq!(stored["request"]["discard_results"], true);
        assert!(ScheduleSpec::from_json("s", &discarding.to_json().unwrap()).unwrap().discards_results());
        assert_eq!(spec.request_tags(), ["schedule:s", "team:x"]);
        assert_eq!(spec.request_id(1_700_000_000_000), "s@1700000000000");
        // A spec with only what another client must write reads back with the defaults.
        let minimal = ScheduleSpec::from_json(
            "m",
            r#"{"cron":"@hourly","missed":"skip","request":{"parts":["AQ=="]}}"#,
        )
        .unwrap();
        assert_eq!(
            (minimal.request_priority(), minimal.part_count(), minimal.missed_policy()),
            (50, 1, Missed::Skip)
        );
    }
}
