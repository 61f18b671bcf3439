"""Cron patterns and time zones checked as the Rust workers that fire schedules read them.

A schedule's pattern is parsed by the Rust library (src/schedule/cron.rs) with the ``croner`` crate
(4.0.3, its default parser: ``Cron::from_str``) and its time zone with ``chrono-tz``. Python never
computes a tick (Python workers do not fire schedules): it only has to accept what the Rust
accepts, and refuse what it refuses, in its words. No Python cron library reads patterns as croner
does (``croniter`` takes a 6th field as seconds *last*, accepts ``0/10`` and ``H``, refuses
``+MON``, ``LW`` and ``5L``, and accepts ``30 2 30 2 *``, which never fires), so this module is a
port of croner's parser, with its error messages, and of the Rust check that a pattern fires at
all. Time zones are the IANA names of the standard library's ``zoneinfo`` (the system's time zone
database, or the ``tzdata`` package). The differences that remain are in docs/python.md
("Operating").

The grammar, as croner has it: 5 fields (minute hour day-of-month month day-of-week), 6 (seconds
first) or 7 (and a year, 1 to 5000); ``@yearly`` ``@annually`` ``@monthly`` ``@weekly`` ``@daily``
``@hourly``; ``*``, ``a``, ``a-b``, ``*/n``, ``a-b/n`` and lists of them; ``JAN``-``DEC`` and
``SUN``-``SAT`` (in any case); ``?`` for ``*`` in the day fields; ``L``, ``LW`` and ``nW`` in the
day of month; ``L``, ``nL`` and ``n#k`` in the day of week (``7`` is Sunday too); a ``+`` before
the day of week asks for both day fields to match (else either does, when neither is ``*``).
"""

from __future__ import annotations

import calendar
import datetime
import functools
import re
import unicodedata
from typing import List, Optional, Set, Tuple

# The bits of a component's positions (croner's component.rs).
_NONE = 0
_ALL = 1
_NTH = (1 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 5)
_NTH_ALL = sum(_NTH)
_LAST = 1 << 6
_CLOSEST = 1 << 7

#: Years a pattern's year field may name (croner's YEAR_LOWER_LIMIT and YEAR_UPPER_LIMIT).
_YEAR_MIN, _YEAR_MAX = 1, 5000

#: Rust's whitespace (``char::is_whitespace``, which ``str::trim`` and ``split_whitespace`` use):
#: Python's ``str.split`` also splits at U+001C to U+001F, which Rust does not.
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_WS_RUN = re.compile(f"[{_WS}]+")
_EDGES = re.compile(f"^[{_WS}]+|[{_WS}]+$")
#: Rust's ``u16::from_str`` and ``u8::from_str``: an optional ``+``, then ASCII digits.
_UNSIGNED = re.compile(r"\+?[0-9]+")

_NICKNAMES = {
    "@YEARLY": "0 0 1 1 *",
    "@ANNUALLY": "0 0 1 1 *",
    "@MONTHLY": "0 0 1 * *",
    "@WEEKLY": "0 0 * * SUN",
    "@DAILY": "0 0 * * *",
    "@HOURLY": "0 * * * *",
}
_WEEKDAYS = (("-SUN", "-7"), ("SUN", "0"), ("MON", "1"), ("TUE", "2"), ("WED", "3"), ("THU", "4"),
             ("FRI", "5"), ("SAT", "6"))
_MONTHS = (("JAN", "1"), ("FEB", "2"), ("MAR", "3"), ("APR", "4"), ("MAY", "5"), ("JUN", "6"), ("JUL", "7"),
           ("AUG", "8"), ("SEP", "9"), ("OCT", "10"), ("NOV", "11"), ("DEC", "12"))
_BASE_CHARS = frozenset("*/0123456789,-")
_DOM_CHARS = _BASE_CHARS | frozenset("LW?")
_DOW_CHARS = _BASE_CHARS | frozenset("#L?")

#: Files of a system's time zone database that chrono-tz does not know (``Factory`` is not in the
#: IANA files it compiles; ``localtime`` is the machine's own zone; ``SystemV/*`` left the IANA
#: database in 2020b).
_NOT_ZONES = frozenset({"Factory", "localtime", "posixrules"})


class CronError(ValueError):
    """A pattern croner refuses; the message is croner's ``CronError`` as it displays."""


def _trim(s: str) -> str:
    return _EDGES.sub("", s)


def _unsigned(s: str, bits: int) -> Optional[int]:
    if not _UNSIGNED.fullmatch(s):
        return None
    n = int(s)
    return n if n < 1 << bits else None


def _component_error(msg: str) -> CronError:
    return CronError(f"Component error: {msg}")


class _Component:
    """One field of a pattern: a bitfield per position (croner's ``CronComponent``)."""

    def __init__(self, lo: int, hi: int, features: int) -> None:
        self.min, self.max = lo, hi
        self.bits = [_NONE] * (hi + 1 if hi > 0 else 0)
        self.features = features | _ALL | _LAST
        self.enabled = _NONE

    def set_bit(self, pos: int, bit: int) -> None:
        if pos < self.min or pos > self.max:
            raise _component_error(f"Position {pos} is out of bounds for the current range ({self.min}-{self.max}).")
        if self.features & bit != bit:
            raise _component_error(
                f"Bit 0b{bit:08b} is not supported by the current features 0b{self.features:08b}."
            )
        self.bits[pos] |= bit

    def is_set(self, pos: int, bit: int) -> bool:
        return self.min <= pos <= self.max and self.bits[pos] & bit != 0

    def values(self) -> List[int]:
        return [i for i in range(self.min, self.max + 1) if self.bits[i] & _ALL]

    def enable(self, feature: int) -> None:
        if self.features & feature != feature:
            raise _component_error(
                f"Feature 0b{feature:08b} is not supported by the current features 0b{self.features:08b}."
            )
        self.enabled |= feature

    def has(self, feature: int) -> bool:
        return self.enabled & feature == feature

    def parse(self, field: str) -> None:
        if field == "*":
            for value in range(self.min, self.max + 1):
                self.set_bit(value, _ALL)
            return
        for part in field.split(","):
            part = _trim(part)
            if not part:
                continue
            if "/" in part:
                self._stepping(part)
            elif "-" in part:
                self._range(part)
            elif "W" in part:
                self._closest_weekday(part)
            elif part.upper() == "L":
                self.enable(_LAST)
            else:
                if part.endswith("L") and "#" not in part:
                    part = part.replace("L", "#L")
                if "#" in part and self.features & _NTH_ALL != _NTH_ALL:
                    raise _component_error("Nth specifier # not allowed in the current field.")
                if "L" in part and self.features & _NTH_ALL != _NTH_ALL:
                    raise _component_error("L not allowed in the current field.")
                self._number(part)

    @staticmethod
    def _nth_bit(value: str) -> int:
        if value.endswith("L"):
            return _LAST
        at = value.find("#")
        if at < 0:
            return _ALL
        nth = _unsigned(value[at + 1:], 8)
        if nth is None:
            raise _component_error("Invalid nth specifier.")
        if nth == 0 or nth > 5:
            raise _component_error("Nth specifier out of bounds.")
        return _NTH[nth - 1]

    def _closest_weekday(self, value: str) -> None:
        day_str = value[: value.find("W")]
        if day_str.upper() == "L":
            self.enable(_LAST)
            self.enable(_CLOSEST)
            return
        day = _unsigned(day_str, 16)
        if day is None:
            raise _component_error("Invalid day for closest weekday.")
        if day < self.min or day > self.max:
            raise _component_error("Day for closest weekday out of bounds.")
        self.set_bit(day, _CLOSEST)

    def _range(self, value: str) -> None:
        bit = self._nth_bit(value)
        parts = [_trim(p) for p in value.split("#")[0].split("-")]
        if len(parts) != 2:
            raise _component_error("Invalid range syntax.")
        start = _unsigned(parts[0], 16)
        if start is None:
            raise _component_error("Invalid start of range.")
        end = _unsigned(parts[1], 16)
        if end is None:
            raise _component_error("Invalid end of range.")
        if start > end or start < self.min or end > self.max:
            raise _component_error("Range out of bounds.")
        for v in range(start, end + 1):
            self.set_bit(v, bit)

    def _number(self, value: str) -> None:
        bit = self._nth_bit(value)
        num = _unsigned(value.split("#")[0], 16)
        if num is None:
            raise _component_error("Invalid number.")
        if num < self.min or num > self.max:
            raise _component_error("Number out of bounds.")
        self.set_bit(num, bit)

    def _stepping(self, value: str) -> None:
        bit = self._nth_bit(value)
        parts = value.split("#")[0].split("/")
        if len(parts) != 2:
            raise _component_error("Invalid stepped range syntax.")
        range_part, step_str = parts
        step = _unsigned(step_str, 16)
        if step is None:
            raise _component_error("Invalid step.")
        if step == 0:
            raise _component_error("Step cannot be zero.")
        if range_part == "*":
            start, end = self.min, self.max
        elif "-" in range_part:
            bounds = range_part.split("-")
            if len(bounds) != 2:
                raise _component_error("Invalid range syntax in stepping.")
            s, e = _unsigned(bounds[0], 16), _unsigned(bounds[1], 16)
            if s is None:
                raise _component_error("Invalid range start.")
            if e is None:
                raise _component_error("Invalid range end.")
            start, end = s, e
        elif not range_part:
            raise _component_error(
                f'Invalid step syntax: omitting the starting point like "/{step_str}" is not allowed. '
                f'Use "*/{step_str}" for wildcard steps or "X-Y/{step_str}" for range steps.'
            )
        else:
            raise _component_error(
                f'Invalid step syntax: single number steps like "{range_part}/{step_str}" are not allowed. '
                f'Use "*/{step_str}" for wildcard steps or "X-Y/{step_str}" for range steps.'
            )
        if start < self.min or end > self.max or start > end:
            raise _component_error("Range is out of bounds in stepping.")
        v = start
        while v <= end:
            self.set_bit(v, bit)
            v += step
            if v > 0xFFFF:  # a u16 in croner
                raise _component_error("Value exceeded max after stepping.")


class _Pattern:
    """A parsed pattern (croner's ``CronPattern``)."""

    def __init__(self, pattern: str) -> None:
        p = _trim(pattern.upper())
        if not p:
            raise CronError("CronPattern cannot be an empty string.")
        if "@" in p:
            p = _NICKNAMES.get(_trim(p), _trim(p))
        for name, number in _WEEKDAYS + _MONTHS:
            p = p.replace(name, number)
        parts = [f for f in _WS_RUN.split(p) if f]
        n = len(parts)
        if n == 5:
            parts.insert(0, "0")
        if len(parts) == 6:
            parts.append("*")
        if not 5 <= n <= 7:
            raise CronError("Invalid pattern: Pattern must have between 5 and 7 fields.")
        parts[3] = parts[3].replace("?", "*")
        parts[5] = parts[5].replace("?", "*")
        self.dom_and_dow = parts[5].startswith("+")
        if self.dom_and_dow:
            parts[5] = parts[5][1:]
        for i, part in enumerate(parts):
            allowed = _DOM_CHARS if i == 3 else _DOW_CHARS if i == 5 else _BASE_CHARS
            for ch in part:
                if ch not in allowed:
                    raise CronError(
                        f"Pattern contains illegal characters: CronPattern contains illegal character '{ch}' in part '{part}'"
                    )
        self.star_dom = parts[3] == "*"
        self.star_dow = parts[5] == "*"
        self.seconds = _Component(0, 59, _NONE)
        self.minutes = _Component(0, 59, _NONE)
        self.hours = _Component(0, 23, _NONE)
        self.days = _Component(1, 31, _LAST | _CLOSEST)
        self.months = _Component(1, 12, _NONE)
        self.days_of_week = _Component(0, 7, _LAST | _NTH_ALL)
        self.years = _Component(_YEAR_MIN, _YEAR_MAX, _NONE)
        for component, field in zip(
            (self.seconds, self.minutes, self.hours, self.days, self.months, self.days_of_week, self.years), parts
        ):
            component.parse(field)
        # 7 is Sunday too.
        dow = self.days_of_week.bits
        dow[0] |= dow[7]
        dow[7] = _NONE

    def day_match(self, month_length: int, day: int, weekday: int) -> bool:
        """Whether ``day`` (of a month ``month_length`` days long; ``weekday`` 0 = Sunday) matches
        the day fields (croner's ``CronPattern::day_match``)."""
        days, dow = self.days, self.days_of_week
        day_matches = days.is_set(day, _ALL)
        if not day_matches and days.has(_LAST) and days.has(_CLOSEST):
            last = (weekday + month_length - day) % 7
            day_matches = day == (month_length - 1 if last == 6 else month_length - 2 if last == 0 else month_length)
        elif not day_matches and days.has(_LAST) and not days.has(_CLOSEST):
            day_matches = day == month_length
        if not day_matches:
            day_matches = self._closest_weekday(month_length, day, weekday)
        dow_matches = dow.is_set(weekday, _NTH[(day - 1) // 7])
        if not dow_matches and dow.is_set(weekday, _LAST) and day + 7 > month_length:
            dow_matches = True
        dow_matches = dow_matches or dow.is_set(weekday, _ALL)
        if (day_matches and self.star_dow) or (dow_matches and self.star_dom):
            return True
        if not self.star_dom and not self.star_dow:
            return (day_matches and dow_matches) if self.dom_and_dow else (day_matches or dow_matches)
        return False

    def _closest_weekday(self, month_length: int, day: int, weekday: int) -> bool:
        for pattern_day in range(max(1, day - 2), min(day + 2, month_length) + 1):
            if not self.days.is_set(pattern_day, _CLOSEST):
                continue
            wd = (weekday + pattern_day - day) % 7
            if 1 <= wd <= 5:
                target = pattern_day
            elif wd == 6:
                target = pattern_day - 1 if pattern_day > 1 else pattern_day + 2
            else:
                target = pattern_day + 1 if pattern_day < month_length else pattern_day - 2
            if target == day:
                return True
        return False

    def fires(self) -> bool:
        """Whether any second of years 1 to 5000 matches (what the Rust check amounts to: croner
        searches no further; of year 1, only its last day can be reached). The calendar of a
        month is its length and the weekday of its first day, so each is looked at once."""
        if not (self.seconds.values() and self.minutes.values() and self.hours.values()):
            return False
        months = self.months.values()
        kinds = sum(14 if m == 2 else 7 for m in months)  # (length, first weekday) of each month
        seen: Set[Tuple[int, int, int]] = set()
        for year in self.years.values():
            if year == _YEAR_MIN:
                if 12 in months and self.day_match(31, 31, 1):  # 0001-12-31 is a Monday
                    return True
                continue
            for month in months:
                first = (datetime.date(year, month, 1).weekday() + 1) % 7  # 0 = Sunday
                length = calendar.monthrange(year, month)[1]
                kind = (month, length, first)
                if kind in seen:
                    continue
                seen.add(kind)
                for day in range(1, length + 1):
                    if self.day_match(length, day, (first + day - 1) % 7):
                        return True
            if len(seen) == kinds:
                return False
        return False


def check(pattern: str) -> None:
    """Refuses a pattern the Rust ``Cron::parse`` refuses, with its message; ``ValueError``."""
    try:
        parsed = _Pattern(pattern)
    except CronError as e:
        raise ValueError(f"invalid cron {rust_quoted(pattern)}: {e}") from None
    if not parsed.fires():
        raise ValueError(f"cron {rust_quoted(pattern)} never fires")


@functools.lru_cache(maxsize=1)
def _zones() -> frozenset:
    import zoneinfo

    return frozenset(zoneinfo.available_timezones()) - _NOT_ZONES


def check_zone(name: str) -> None:
    """Refuses a time zone that is not an IANA name (``zoneinfo``'s, less the files chrono-tz does
    not know), with the Rust message; ``ValueError``."""
    zones = _zones()
    if name in zones and not name.startswith("SystemV/"):
        return
    hint = "" if zones else " (this Python finds no time zone database: pip install tzdata)"
    raise ValueError(
        f"unknown time zone {rust_quoted(name)}: use an IANA name such as Europe/Rome or America/New_York{hint}"
    )


_ESCAPES = {"\t": "\\t", "\r": "\\r", "\n": "\\n", "\0": "\\0", '"': '\\"', "\\": "\\\\"}
#: The general categories whose characters Rust's ``{:?}`` shows as ``\u{..}`` (its
#: ``is_printable`` is false for them; a space is printable).
_UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"})


def _escaped(ch: str) -> bool:
    if ch == " ":
        return False
    # Unprintable, or a grapheme extender (Me, Mn and a few Mc; Python has no Grapheme_Extend
    # property: the Mc ones show as they are here, escaped by Rust).
    return unicodedata.category(ch) in _UNPRINTABLE or unicodedata.category(ch) in ("Mn", "Me")


def rust_quoted(s: str) -> str:
    """``s`` as Rust's ``{:?}`` shows a string: in double quotes, with ``\\"``, ``\\\\``, ``\\t``,
    ``\\r``, ``\\n``, ``\\0``, and other characters that are not printable (controls, format
    characters, spaces other than U+0020, unassigned ones) or that extend a grapheme as
    ``\\u{..}``. (The Unicode versions of this Python and of the Rust build may differ.)"""
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif _escaped(ch):
            out.append(f"\\u{{{ord(ch):x}}}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
