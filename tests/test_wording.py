"""word (``alerts.py``, ``wording.py``): an alert's record and its text."""

from __future__ import annotations

import math

from lightning_monitor.alerts import Alert, AlertKind

NAN, INF = float("nan"), float("inf")


def test_alert_json_round_trip_with_nonfinite_values():
    alert = Alert(AlertKind.NONFINITE_GRAD, 3, 1, INF, None, "m", halted=True, rank=1)
    data = alert.to_dict()
    assert data["value"] == "inf" and data["rank"] == 1
    back = Alert.from_dict(data)
    assert back == alert and math.isinf(back.value)


def test_the_steps_applied_unchecked_are_counted_in_words():
    from lightning_monitor.deferred import OnDevice
    from lightning_monitor.wording import AlertContext, _what_was_done

    def said(covered: int, **kwargs: object) -> str:
        return _what_was_done(AlertContext(at=4, epoch=0, skipped=True, covered=covered, every=4, **kwargs))

    assert said(2) == (
        "This optimizer step was skipped, but the step before it since the last check (check_every_n_steps=4) was"
        " applied unchecked."
    )
    assert said(4).startswith("This optimizer step was skipped, but the 3 steps before it since the last check")
    assert said(4).endswith("were applied unchecked.")
    deferred = said(2, on_device=OnDevice.ZEROED)
    assert deferred.endswith(" The step before it since the last check (check_every_n_steps=4) was applied.")
    assert said(3, on_device=OnDevice.ZEROED).endswith(
        " The 2 steps before it since the last check (check_every_n_steps=4) were applied."
    )
