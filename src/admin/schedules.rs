//! Operating schedules (`schedules` feature): add, replace, list, pause, resume, remove. The
//! firing is the workers' (`crate::schedule`); these calls only change what they will fire.

use std::sync::Arc;

use super::Admin;
use crate::error::{Error, Result};
use crate::producer::Producer;
use crate::protocol::schedules::{self, Stored, Switched};
use crate::schedule::{check_schedule_name, Schedule, ScheduleSpec};
use crate::stats::Recorder;

impl Admin {
    /// Adds a schedule: from now on each of its ticks submits one request, `<name>@<tick ms>`
    /// (docs/operations.md, "Schedules"). Its first tick is the first after now (Redis time).
    /// Adding the very same spec again changes nothing; another spec under a name in use is
    /// refused with [`Error::ScheduleExists`] (see [`schedule_replace`](Self::schedule_replace)).
    /// The spec is checked first, as a producer would check each tick's request: an invalid one
    /// is refused with [`Error::InvalidSchedule`] (or the error a submit would give).
    ///
    /// ```no_run
    /// # async fn demo(admin: sluicegate::Admin) -> sluicegate::Result<()> {
    /// use sluicegate::ScheduleSpec;
    /// let spec = ScheduleSpec::new("hourly-sync", "0 * * * *")?.parts(["sync"])?;
    /// admin.schedule_add(&spec).await?;
    /// # Ok(()) }
    /// ```
    pub async fn schedule_add(&self, spec: &ScheduleSpec) -> Result<()> {
        let json = self.checked(spec)?;
        match schedules::add(&self.store, spec.name(), &json, false).await? {
            Stored::Exists => Err(Error::ScheduleExists(spec.name().to_owned())),
            Stored::New | Stored::Replaced | Stored::Same => Ok(()),
        }
    }

    /// Adds a schedule, or replaces the one of that name: the new spec is active (not paused)
    /// from now, its first tick the first after now; ticks the old one fell due for and no worker
    /// fired yet are not owed; ticks it owed are submitted with the new template.
    pub async fn schedule_replace(&self, spec: &ScheduleSpec) -> Result<()> {
        let json = self.checked(spec)?;
        schedules::add(&self.store, spec.name(), &json, true).await?;
        Ok(())
    }

    /// Every schedule, by name.
    pub async fn schedules(&self) -> Result<Vec<Schedule>> {
        let mut out = Vec::new();
        for (name, json) in schedules::all(&self.store).await? {
            let spec = ScheduleSpec::from_json(&name, &json)?;
            let read = schedules::get(&self.store, &name).await?;
            out.push(Schedule::from_read(&spec, &read.state));
        }
        Ok(out)
    }

    /// One schedule; [`Error::UnknownSchedule`] if there is none of that name.
    pub async fn schedule(&self, name: &str) -> Result<Schedule> {
        check_schedule_name(name)?;
        let read = schedules::get(&self.store, name).await?;
        let json = read.spec.ok_or_else(|| Error::UnknownSchedule(name.to_owned()))?;
        Ok(Schedule::from_read(&ScheduleSpec::from_json(name, &json)?, &read.state))
    }

    /// Pauses a schedule: ticks after now are not owed until it is resumed (those due before
    /// are still fired). Returns false if it was paused already.
    pub async fn schedule_pause(&self, name: &str) -> Result<bool> {
        self.switch(name, true).await
    }

    /// Resumes a paused schedule: ticks after now are owed again; those that fell while it was
    /// paused never are. Returns false if it was not paused.
    pub async fn schedule_resume(&self, name: &str) -> Result<bool> {
        self.switch(name, false).await
    }

    /// Removes a schedule. Its requests stay (cancel or purge them by their tag,
    /// `schedule:<name>`); ticks it owed whose requests were not submitted yet are dropped.
    pub async fn schedule_remove(&self, name: &str) -> Result<()> {
        check_schedule_name(name)?;
        if schedules::del(&self.store, name).await? {
            Ok(())
        } else {
            Err(Error::UnknownSchedule(name.to_owned()))
        }
    }

    async fn switch(&self, name: &str, pause: bool) -> Result<bool> {
        check_schedule_name(name)?;
        match schedules::pause(&self.store, name, pause).await? {
            Switched::Done => Ok(true),
            Switched::Already => Ok(false),
            Switched::Unknown => Err(Error::UnknownSchedule(name.to_owned())),
        }
    }

    /// The spec as stored, once checked as a producer checks a request: each tick's request is
    /// built with a producer's builder (nothing is sent).
    fn checked(&self, spec: &ScheduleSpec) -> Result<String> {
        let json = spec.validate()?;
        let producer = Producer::from_store(self.store.clone(), Arc::new(Recorder::off()));
        let _checked = spec.request(producer.request(), 0)?;
        Ok(json)
    }
}
