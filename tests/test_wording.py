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
