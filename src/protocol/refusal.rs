//! The errors the Functions library answers with when it refuses a call: `SG<CODE> <why>`
//! (docs/protocol.md §5). Recognised here only, and private to `protocol`: what a refusal means
//! depends on the function, so each typed call turns it into the [`Error`](crate::Error) variant
//! its reader can act on (`SGDUPLICATE` → `DuplicateRequestId`, `SGSTATE` → `NotOpen`, `Expired`
//! or `NoDeadLetters`, ...), or, for `SGLATE`, says so with `ran_past_deadline`.

use crate::error::Error;

/// Which refusal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Code {
    /// `SGDUPLICATE`: the request id is in use (live or retained).
    Duplicate,
    /// `SGGAP`: parts before the ones sent are missing.
    Gap,
    /// `SGINCOMPLETE`: a commit found the stream without every part.
    Incomplete,
    /// `SGINVALID`: an argument is out of range.
    Invalid,
    /// `SGLATE`: the call came after its deadline and wrote nothing.
    Late,
    /// `SGSTATE`: the request is not in a state that allows the call.
    State,
}

impl Code {
    const ALL: [(Code, &'static str); 6] = [
        (Code::Duplicate, "SGDUPLICATE"),
        (Code::Gap, "SGGAP"),
        (Code::Incomplete, "SGINCOMPLETE"),
        (Code::Invalid, "SGINVALID"),
        (Code::Late, "SGLATE"),
        (Code::State, "SGSTATE"),
    ];
}

/// A refusal: its code and the library's words for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub(crate) code: Code,
    pub(crate) why: String,
}

impl Refusal {
    /// The refusal `error` carries, if it is one: a Redis error reply that starts with an SG code.
    pub(crate) fn of(error: &Error) -> Option<Refusal> {
        let Error::Redis(e) = error else { return None };
        Self::parse(e.message())
    }

    /// The refusal a reply's text `details` is, if it is one (`SG<CODE> <why>`).
    pub(super) fn parse(details: &str) -> Option<Refusal> {
        let (word, why) = details.split_once(' ').unwrap_or((details, ""));
        let code = Code::ALL.iter().find(|(_, name)| *name == word)?.0;
        Some(Refusal { code, why: why.to_owned() })
    }

    /// The refusal of `error` if it has `code`.
    pub(crate) fn is(error: &Error, code: Code) -> Option<Refusal> {
        Self::of(error).filter(|r| r.code == code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_recognised_by_their_whole_code_word() {
        let r = Refusal::parse("SGSTATE the request is not open").expect("a refusal");
        assert_eq!((r.code, r.why.as_str()), (Code::State, "the request is not open"));
        assert_eq!(Refusal::parse("SGLATE").map(|r| r.code), Some(Code::Late));
        assert_eq!(Refusal::parse("SGSTATEX nope"), None);
        assert_eq!(Refusal::parse("ERR SGSTATE inside"), None);
        assert_eq!(Refusal::parse("NOPERM this user has no permissions"), None);
    }

    /// Every code a Lua file raises is one this module knows, and every code it knows is raised.
    #[test]
    fn the_library_raises_exactly_the_known_codes() {
        let library = super::super::library_source();
        let mut raised: Vec<&str> = library
            .match_indices("error_reply('SG")
            .map(|(i, m)| {
                let rest = &library[i + m.len() - 2..];
                &rest[..rest.find([' ', '\'']).unwrap_or(rest.len())]
            })
            .collect();
        raised.sort_unstable();
        raised.dedup();
        let known: Vec<&str> = Code::ALL.iter().map(|(_, name)| *name).collect();
        assert_eq!(raised, known);
    }
}
