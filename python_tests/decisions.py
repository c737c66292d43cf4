"""Helpers of the one-decision tests: run a call that may fail on some ranks, and check that every
rank reached the same verdict (the same error type and the same message, naming what it must)."""


def outcome(fn):
    """('ok', None) or (exception type name, message); never lets an exception out."""
    try:
        fn()
        return ("ok", None)
    except Exception as e:  # noqa: BLE001 - the type is the result
        return (type(e).__name__, str(e))


def same_decision(got, kind: str, words, case) -> str:
    """``got``: every rank's ``outcome``. Every rank raised ``kind`` (never a
    ``DistributedStepError``: no rank waited out a timeout) with one message holding every one of
    ``words``; returns that message."""
    assert {k for k, _ in got} == {kind}, (case, got)
    messages = {m for _, m in got}
    assert len(messages) == 1, (case, got)  # the same error on every rank
    message = messages.pop()
    for word in words:
        assert word in message, (case, word, message)
    return message


def check_cases(ranks, expected) -> None:
    """``ranks``: every rank's dict of case -> ``outcome`` (or (``outcome``, whether this rank's
    object is unchanged)); ``expected``: case -> (error type, words of its message)."""
    for case, (kind, words) in expected.items():
        got = [r[case] for r in ranks]
        if isinstance(got[0][0], tuple):  # (outcome, unchanged on this rank)
            assert all(unchanged for _, unchanged in got), (case, got)  # nothing changed
            got = [result for result, _ in got]
        same_decision(got, kind, words, case)
