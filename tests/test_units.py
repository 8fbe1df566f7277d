"""The pure functions, in process: job validation and parsing, ids,
durations, times, backoff, settings, and fitting a record into
max_job_bytes. No subprocess and no sleep: this file runs in a few seconds."""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from spoolq import config, record
from spoolq.config import ConfigError
from spoolq.protocol import id_problem
from spoolq.record import MAX_EPOCH, MAX_TIMEOUT, Incomplete, InvalidJob
from spoolq.runner import _tail_text as tail_text
from spoolq.record import fitted

quick = settings(max_examples=200, deadline=None)

VALID_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}\Z")
ids = st.from_regex(VALID_ID, fullmatch=True).filter(lambda s: ".." not in s)


# --------------------------------------------------------------------------
# ids


@quick
@given(ids)
def test_every_id_of_the_documented_alphabet_is_accepted(job_id):
    assert id_problem(job_id) is None


@quick
@given(st.text(max_size=140))
def test_an_id_is_accepted_exactly_when_it_is_1_to_128_safe_characters_without_dots_in_front_or_in_pairs(job_id):
    good = bool(VALID_ID.match(job_id)) and ".." not in job_id
    assert (id_problem(job_id) is None) == good


@pytest.mark.parametrize("job_id, says", [
    ("../x", "contains '/'"), ("a/b", "contains '/'"), ("a..b", "contains '..'"), (".hidden", "starts with a dot"),
    ("", "is not 1-128 characters"), ("x" * 129, "is not 1-128 characters"), ("sp ace", "is not 1-128 characters"),
    (5, "id must be a string"), (None, "id must be a string"),
])
def test_a_bad_id_is_refused_with_its_reason(job_id, says):
    assert says in id_problem(job_id)


# --------------------------------------------------------------------------
# validation and parsing


@pytest.mark.parametrize("job", [
    {"command": "true"},
    {"argv": ["echo", "hi"]},
    {"kind": "mail", "payload": {"to": "x"}},
    {"command": "true", "argv": None, "kind": None},  # null counts as absent
    {"command": "true", "max_attempts": 3, "timeout": 1.5, "run_at": "2026-01-31T09:00:00Z",
     "env": {"A": "b"}, "cwd": "/tmp", "attempts": 0, "history": [], "unknown": [1, 2]},
    {"command": "true", "timeout": 0}, {"command": "true", "timeout": MAX_TIMEOUT}, {"command": "true", "run_at": 0},
])
def test_a_good_job_validates(job):
    record.validate(job)


@pytest.mark.parametrize("job, says", [
    ({}, "exactly one of command, argv or kind; it has none"),
    ({"command": "a", "argv": ["b"]}, "it has command, argv"),
    ({"command": ""}, "command must be a non-empty string"),
    ({"command": "   "}, "command must be a non-empty string"),
    ({"command": 5}, "command must be a non-empty string"),
    ({"command": "a\x00b"}, "command contains a NUL"),
    ({"argv": []}, "argv must be a non-empty list of strings"),
    ({"argv": ["a", 1]}, "argv must be a non-empty list of strings"),
    ({"argv": "echo"}, "argv must be a non-empty list of strings"),
    ({"argv": [""]}, "argv[0] must not be empty"),
    ({"argv": ["a", "b\x00"]}, "argv contains a NUL"),
    ({"kind": ""}, "kind must be a non-empty string"),
    ({"kind": 3}, "kind must be a non-empty string"),
    ({"command": "a", "id": "../x"}, "contains '/'"),
    ({"command": "a", "max_attempts": 0}, "max_attempts must be an integer >= 1"),
    ({"command": "a", "max_attempts": True}, "max_attempts must be an integer >= 1"),
    ({"command": "a", "max_attempts": 2.0}, "max_attempts must be an integer >= 1"),
    ({"command": "a", "timeout": -1}, "timeout must be a number of seconds"),
    ({"command": "a", "timeout": MAX_TIMEOUT + 1}, "timeout must be a number of seconds"),
    ({"command": "a", "timeout": "5"}, "timeout must be a number of seconds"),
    ({"command": "a", "timeout": math.nan}, "timeout must be a number of seconds"),
    ({"command": "a", "timeout": False}, "timeout must be a number of seconds"),
    ({"command": "a", "run_at": "tomorrow"}, "run_at:"),
    ({"command": "a", "run_at": -1}, "run_at:"),
    ({"command": "a", "env": ["A=b"]}, "env must be an object of strings"),
    ({"command": "a", "env": {"A": 1}}, "env['A'] must be a string, not int"),
    ({"command": "a", "env": {"": "x"}}, "is empty or contains '='"),
    ({"command": "a", "env": {"A=B": "x"}}, "is empty or contains '='"),
    ({"command": "a", "env": {"A": "x\x00"}}, "env contains a NUL"),
    ({"command": "a", "cwd": ""}, "cwd must be a non-empty string"),
    ({"command": "a", "cwd": 1}, "cwd must be a non-empty string"),
    ({"command": "a", "attempts": -1}, "attempts must be an integer >= 0"),
    ({"command": "a", "history": {}}, "history must be a list"),
])
def test_a_bad_job_is_refused_with_its_reason(job, says):
    with pytest.raises(InvalidJob) as e:
        record.validate(job)
    assert says in str(e.value)


def test_the_file_names_id_wins_over_the_id_field():
    assert record.parse(b'{"command": "true", "id": "other"}', "named")["id"] == "named"
    assert record.parse(b'\xef\xbb\xbf{"command": "true"}', "bom")["id"] == "bom"  # a BOM is read past


@pytest.mark.parametrize("data", [b"", b"   \n", b'{"command": "tr', b'{"command": "caf\xc3'])
def test_bytes_that_more_bytes_could_make_a_job_are_incomplete(data):
    with pytest.raises(Incomplete):
        record.parse(data, "x")


@pytest.mark.parametrize("data, says", [
    (b"[1, 2]", "not a JSON object but an array"), (b'"job"', "not a JSON object but a string"),
    (b"null", "not a JSON object but null"), (b"true", "not a JSON object but a boolean"),
    (b"\xff{}", "not UTF-8 (byte 0)"), (b"nonsense", "not valid JSON"),
    (b'{"command": "true", "n": NaN}', "not valid JSON"), (b'{"command": "true", "n": 1e999}', "too large"),
    (b'{"command": "true", "p": ' + b"[" * 300 + b"]" * 300 + b"}", "nested more than 256 levels deep"),
    (b'{"argv": []}', "argv must be"),
])
def test_bytes_that_can_never_be_a_job_are_invalid_not_incomplete(data, says):
    with pytest.raises(InvalidJob) as e:
        record.parse(data, "x")
    assert not isinstance(e.value, Incomplete) and says in str(e.value)


@quick
@given(st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in record.SPOOLQ_FIELDS
                                                                   and k not in ("command", "argv", "kind", "max_attempts",
                                                                                 "timeout", "run_at", "env", "cwd")),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                                    max_leaves=10),
                       max_size=5),
       ids)
def test_a_job_serialised_by_spoolq_parses_back_to_itself(extra, job_id):
    job = {**extra, "command": "true"}
    data = record.serialise(job)
    assert record.parse(data, job_id) == {**job, "id": job_id}


def test_a_file_over_max_job_bytes_is_refused_unless_it_is_spoolqs_own_record_within_the_slack():
    producer = {"command": "true", "pad": "x" * 900}
    with pytest.raises(InvalidJob, match=r"larger than max_job_bytes \(500\)"):
        record.parse_sized(record.dumps(producer), "x", 500)
    own = {"command": "true", "history": [{"attempt": 1, "error": "e" * 900}]}
    assert record.parse_sized(record.dumps(own), "x", 500)["history"]  # its producer fields fit in 500
    too_far = {"command": "true", "history": [{"attempt": 1, "error": "e" * (record.RECORD_SLACK + 1000)}]}
    with pytest.raises(InvalidJob, match="larger than max_job_bytes"):
        record.parse_sized(record.dumps(too_far), "x", 500)
    fat_producer = {"command": "true", "pad": "x" * 900, "history": [{"attempt": 1}]}
    with pytest.raises(InvalidJob, match="larger than max_job_bytes"):
        record.parse_sized(record.dumps(fat_producer), "x", 500)


def test_serialise_refuses_what_is_not_json():
    for job in ({"command": "true", "n": math.nan}, {"command": "true", "s": {1, 2}}):
        with pytest.raises(InvalidJob, match="not JSON"):
            record.serialise(job)
    deep: list = []
    for _ in range(300):
        deep = [deep]
    with pytest.raises(InvalidJob, match="nested more than"):
        record.serialise({"command": "true", "p": deep})


# --------------------------------------------------------------------------
# durations


@pytest.mark.parametrize("text, seconds", [
    ("90", 90), ("90s", 90), ("5m", 300), ("2h", 7200), ("7d", 604800), ("1w", 604800), ("1.5h", 5400),
    ("10min", 600), ("2 hours", 7200), ("1h30m", 5400), ("1h 30m 15s", 5415), ("3 Days", 259200),
    ("  45 sec ", 45), ("1 week 1 day", 691200), ("0", 0), (90, 90), (1.5, 1.5), ("0.5s", 0.5),
])
def test_durations_in_every_accepted_spelling(text, seconds):
    assert record.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "  ", "1h30", "30 1h", "5x", "-5", "-5s", "h", "1.h", "5m-", "1e3",
                                  -1, math.inf, math.nan, True, None, "1,5h"])
def test_what_is_not_a_duration_is_refused(text):
    with pytest.raises(ValueError):
        record.parse_duration(text)


UNITS = {"s": 1, "sec": 1, "seconds": 1, "m": 60, "min": 60, "minutes": 60, "h": 3600, "hours": 3600,
         "d": 86400, "days": 86400, "w": 604800, "weeks": 604800}


@quick
@given(st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(sorted(UNITS))), min_size=1, max_size=5),
       st.sampled_from(["", " "]))
def test_a_duration_is_the_sum_of_its_parts(parts, sep):
    text = sep.join(f"{n}{sep}{unit}" for n, unit in parts)
    assert record.parse_duration(text) == sum(n * UNITS[unit] for n, unit in parts)


# --------------------------------------------------------------------------
# times


@quick
@given(st.integers(0, MAX_EPOCH * 10**6))
def test_rfc3339_round_trips_to_the_microsecond(micros):
    ts = micros / 1e6
    text = record.rfc3339(ts)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", text), text
    assert abs(record.parse_time(text) - ts) < 2e-6


@quick
@given(st.integers(0, MAX_EPOCH - 86400 * 2), st.integers(-14 * 60, 14 * 60))
def test_a_time_with_an_offset_is_the_same_instant_as_in_utc(ts, offset_minutes):
    import time as _time

    local = _time.strftime("%Y-%m-%dT%H:%M:%S", _time.gmtime(ts + 86400 + offset_minutes * 60))
    sign = "+" if offset_minutes >= 0 else "-"
    hours, minutes = divmod(abs(offset_minutes), 60)
    assert record.parse_time(f"{local}{sign}{hours:02d}:{minutes:02d}") == ts + 86400


@pytest.mark.parametrize("value, ts", [
    ("2026-01-31T09:00:00Z", 1769850000), ("2026-01-31T10:00:00+01:00", 1769850000), ("2026-01-31 09:00Z", 1769850000),
    ("2026-01-31t09:00:00.5z", 1769850000.5), ("1769850000", 1769850000), (1769850000, 1769850000),
    (0, 0), (MAX_EPOCH, MAX_EPOCH), ("1970-01-01T00:00:00Z", 0),
])
def test_times_in_every_accepted_form(value, ts):
    assert record.parse_time(value) == ts


@pytest.mark.parametrize("value", [
    "2026-01-31T09:00:00", "2026-02-30T09:00:00Z", "2026-01-31T25:00:00Z", "tomorrow", "", -1, MAX_EPOCH + 1,
    math.nan, math.inf, True, None, [], 10**400, "2200-01-02T00:00:00Z", "1969-12-31T23:59:59Z",
    "2026-01-31T09:00:00.123456Y",
])
def test_what_is_not_a_time_in_bounds_is_refused(value):
    with pytest.raises(ValueError):
        record.parse_time(value)


# --------------------------------------------------------------------------
# backoff


backoff_settings = st.fixed_dictionaries({
    "backoff_initial": st.floats(0, 10**6), "backoff_factor": st.floats(1, 100), "backoff_max": st.floats(0, 10**7),
})


@quick
@given(backoff_settings, st.integers(1, 10_000), st.floats(-0.1, 0.1))
def test_backoff_grows_by_its_factor_up_to_its_cap_with_at_most_ten_percent_jitter(s, failures, jitter):
    delay = config.backoff(s, failures, jitter)
    try:
        uncapped = s["backoff_initial"] * s["backoff_factor"] ** (failures - 1)
    except OverflowError:
        uncapped = math.inf
    expected = min(s["backoff_max"], uncapped)
    assert math.isfinite(delay) and delay >= 0
    assert expected * 0.9 - 1e-6 <= delay <= expected * 1.1 + 1e-6
    assert delay <= s["backoff_max"] * 1.1 + 1e-6


@quick
@given(backoff_settings, st.integers(1, 200))
def test_backoff_never_shrinks_from_one_failure_to_the_next(s, failures):
    assert config.backoff(s, failures, 0.0) <= config.backoff(s, failures + 1, 0.0)


def test_backoff_worked_examples():
    s = {"backoff_initial": 100, "backoff_factor": 3, "backoff_max": 3600}
    assert [config.backoff(s, n, 0.0) for n in (1, 2, 3, 4, 5)] == [100, 300, 900, 2700, 3600]
    assert config.backoff(s, 2, 0.1) == pytest.approx(330) and config.backoff(s, 2, -0.1) == pytest.approx(270)
    assert config.backoff({**s, "backoff_initial": 0}, 9, 0.1) == 0  # zero stays zero
    assert config.backoff({**s, "backoff_initial": 1000, "backoff_max": 50}, 1, 0.0) == 50  # the cap, already at once
    assert config.backoff({**s, "backoff_factor": 10}, 10**6, 0.0) == 3600  # no overflow


# --------------------------------------------------------------------------
# settings


@pytest.mark.parametrize("key, given_value, stored", [
    ("max_attempts", "3", 3), ("max_attempts", 1, 1), ("max_attempts", 2.0, 2),
    ("output_limit", "0", 0), ("compact_after", 0, 0), ("max_job_bytes", "1", 1),
    ("backoff_factor", "1.5", 1.5), ("backoff_factor", 1, 1),
    ("backoff_initial", "5m", 300), ("backoff_initial", "0", 0), ("backoff_initial", "1.5h", 5400),
    ("backoff_max", "1h30m", 5400), ("timeout", "0", 0), ("timeout", "2 hours", 7200), ("timeout_grace", 0.5, 0.5),
    ("rescan_interval", "10s", 10), ("rescan_interval", 0.5, 0.5),
    ("fsync", "false", False), ("fsync", "on", True), ("fsync", "NO", False), ("fsync", 1, True), ("fsync", True, True),
    ("trusted_users", "", []), ("trusted_users", "root", ["root"]), ("trusted_users", "0, 1000", ["0", "1000"]),
    ("trusted_users", '["root", 0]', ["root", "0"]), ("trusted_users", [0], ["0"]),
])
def test_each_setting_accepts_its_values_and_stores_them_in_its_type(key, given_value, stored):
    value = config.check(key, given_value)
    assert value == stored and type(value) is type(stored)


@pytest.mark.parametrize("key, given_value, says", [
    ("max_attempts", "0", "max_attempts must be >= 1"), ("max_attempts", "1.5", "must be a whole number"),
    ("max_attempts", "many", "must be a number"), ("max_attempts", True, "must be a number"),
    ("output_limit", -1, "must be >= 0"), ("max_job_bytes", 0, "must be >= 1"),
    ("backoff_factor", 0.5, "must be >= 1"), ("backoff_factor", "NaN", "must be a number"),
    ("backoff_initial", "-5", "must be >= 0"), ("backoff_initial", "soon", "must be a duration"),
    ("backoff_max", "20000w", "must be <="), ("timeout", MAX_TIMEOUT + 1, "must be <="),
    ("rescan_interval", 0, "must be > 0"), ("rescan_interval", "0s", "must be > 0"),
    ("fsync", "maybe", "must be true or false"), ("fsync", 2, "must be true or false"),
    ("trusted_users", "[1,", "must be a list of user names"), ("trusted_users", [True], "list of user names or uids"),
    ("trusted_users", "no-such-user-spoolq-test", "no user 'no-such-user-spoolq-test'"),
    ("colour", "blue", "unknown setting 'colour'"),
])
def test_each_setting_refuses_bad_values_naming_the_key_and_the_value(key, given_value, says):
    with pytest.raises(ConfigError) as e:
        config.check(key, given_value)
    assert says in str(e.value)


def test_a_duration_given_as_text_names_what_was_given_when_refused():
    with pytest.raises(ConfigError, match=r"\(given as '20000w'\)"):
        config.check("timeout", "20000w")


def test_stored_settings_beyond_a_cap_are_taken_as_the_cap_and_stored_user_names_are_not_looked_up():
    assert config.check("timeout", MAX_TIMEOUT * 2, stored=True) == MAX_TIMEOUT
    assert config.check("trusted_users", ["nobody-here-spoolq"], stored=True) == ["nobody-here-spoolq"]


@quick
@given(st.sampled_from(sorted(config.DEFAULTS)))
def test_every_default_passes_its_own_check(key):
    assert config.check(key, config.DEFAULTS[key], stored=True) == config.DEFAULTS[key]


def test_loading_settings_merges_config_json_over_the_defaults(tmp_path):
    assert config.load(str(tmp_path)) == config.DEFAULTS
    (tmp_path / "config.json").write_text(json.dumps({"max_attempts": 2, "timeout": "5m", "fsync": "off"}))
    assert config.load(str(tmp_path)) == {**config.DEFAULTS, "max_attempts": 2, "timeout": 300, "fsync": False}
    assert config.read_stored(str(tmp_path))[0] == {"max_attempts": 2, "timeout": "5m", "fsync": "off"}


@pytest.mark.parametrize("text, says", [
    ("{", "is not valid JSON"), ("[]", "must hold a JSON object"),
    ('{"max_attempts": 0}', "config.json: max_attempts must be >= 1"), ('{"colour": 1}', "unknown setting 'colour'"),
])
def test_a_broken_config_json_is_an_error_naming_the_file(tmp_path, text, says):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        config.load(str(tmp_path))
    assert says in str(e.value) and str(tmp_path / "config.json") in str(e.value)


def test_an_empty_config_json_is_the_defaults(tmp_path):
    (tmp_path / "config.json").write_bytes(b"")
    assert config.load(str(tmp_path)) == config.DEFAULTS


# --------------------------------------------------------------------------
# output tails and fitting a record into max_job_bytes


@quick
@given(st.text(max_size=300), st.integers(0, 400))
def test_an_output_tail_is_the_last_limit_bytes(text, limit):
    tail = tail_text(text, limit)
    data = text.encode("utf-8", "backslashreplace")
    if limit == 0:
        assert tail == ""
    elif len(data) <= limit:
        assert tail == text
    else:
        assert tail == data[-limit:].decode("utf-8", errors="replace")  # a cut character becomes U+FFFD


def _run(attempt: int, error_size: int) -> dict:
    return {"attempt": attempt, "worker": "host:1", "start": "2026-01-31T09:00:00.000000Z",
            "end": "2026-01-31T09:00:01.000000Z", "exit_code": 1, "error": "e" * error_size}


records = st.fixed_dictionaries({
    "runs": st.integers(1, 60), "error_size": st.integers(0, 300), "stdout": st.text(max_size=3000),
    "stderr": st.text(max_size=3000), "result": st.none() | st.text(max_size=2000),
    "own": st.text(max_size=200), "limit": st.integers(300, 20000),
})


@quick
@given(records)
def test_a_fitted_record_fits_and_keeps_the_jobs_own_fields_the_newest_run_and_the_ends_of_the_outputs(r):
    own = {"command": "true", "id": "job", "note": r["own"]}
    job = {**own, "attempts": r["runs"], "state": "failed", "history": [_run(i + 1, r["error_size"]) for i in range(r["runs"])]}
    for key in ("stdout", "stderr"):
        if r[key]:
            job[key] = r[key]
    if r["result"] is not None:
        job["result"] = r["result"]
    original = json.loads(json.dumps(job))
    data = fitted(job, r["limit"])
    back = json.loads(data)
    assert data == record.dumps(back)
    assert {k: back[k] for k in own} == own  # never cut
    assert back["history"][-1] == original["history"][-1]  # the newest run is always kept
    kept = len(back["history"])
    assert back["history"] == original["history"][-kept:]  # the oldest go first ...
    assert back.get("history_dropped", 0) == r["runs"] - kept  # ... and are counted
    for key in ("stdout", "stderr"):
        assert original.get(key, "").endswith(back.get(key, ""))  # a tail: the start is cut
    if "result" in original and "result" not in back:
        assert "does not fit in max_job_bytes" in back["result_dropped"]
    minimal = dict(own, attempts=r["runs"], state="failed", history=[original["history"][-1]], history_dropped=r["runs"])
    if len(record.dumps(minimal)) + 200 <= r["limit"]:  # room for the job and its newest run
        assert len(data) <= r["limit"], (len(data), r["limit"])


def test_a_record_that_fits_is_left_as_it_is():
    job = {"command": "true", "history": [_run(1, 10)], "stdout": "out\n", "result": [1, 2]}
    assert fitted(dict(job), 10_000) == record.dumps(job)


def test_fitting_cuts_outputs_before_the_result_and_the_result_before_the_history():
    job = {"command": "true", "history": [_run(i, 0) for i in range(1, 4)], "stdout": "o" * 3000, "result": "r" * 600}
    data = fitted(json.loads(json.dumps(job)), len(record.dumps(job)) - 1000)
    back = json.loads(data)
    assert back["result"] == job["result"] and len(back["history"]) == 3 and len(back["stdout"]) < 3000
    data = fitted(json.loads(json.dumps(job)), len(record.dumps({**job, "stdout": ""})) - 300)
    back = json.loads(data)
    assert "stdout" not in back and "result" not in back and re.match(r"a result of \d+ bytes does not fit", back["result_dropped"])
    assert len(back["history"]) == 3


def test_runs_dropped_earlier_are_added_to():
    job = {"command": "true", "history": [_run(i, 500) for i in range(1, 6)], "history_dropped": 7}
    back = json.loads(fitted(job, 1200))
    assert len(back["history"]) < 5 and back["history_dropped"] == 7 + 5 - len(back["history"])


@pytest.mark.parametrize("text, reason", [
    ('{"command": "x', "not valid JSON: Unterminated string starting at line 1 column 13"),
    ('{"command": }', "not valid JSON: Expecting value at line 1 column 13"),
])
def test_a_json_problem_is_said_once_with_where(text, reason):
    with pytest.raises(InvalidJob) as e:
        record.parse(text.encode(), "x")
    assert str(e.value) == reason
