"""What a run did so far: its alerts, its skipped steps, why it halted, and the escalation ladder. One object."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_monitor.alerts import Alert, AlertKind
from lightning_monitor.decision import Ladder

__all__ = ["RunState"]


@dataclass
class RunState:
    """The state :class:`~lightning_monitor.TrainingMonitor` keeps for a run, saved in checkpoints.

    Attributes:
        alerts: Every alert so far, oldest first.
        skipped_steps: Optimizer steps kept from the weights so far (by the monitor, or by the GradScaler under fp16
            AMP).
        stopping_reason: The kind of the alert that halted the run, or ``None``.
        stopping_reason_message: That alert's message, or ``None``.
        ladder: The escalation ladder: the recent checks at which a step-level problem was beyond its limit.
        checks: Checks judged so far, per optimizer index: the ladder's clock, kept across a resume.

    Example:
        >>> from lightning_monitor.alerts import AlertKind
        >>> state = RunState()
        >>> state.alerts.append(Alert(AlertKind.NONFINITE_LOSS, 3, 0, float("nan"), None, "training loss is nan"))
        >>> restored = RunState()
        >>> restored.load_state_dict(state.state_dict())
        >>> len(restored.alerts), restored.stopping_reason  # a resumed run has not halted
        (1, None)
    """

    alerts: list[Alert] = field(default_factory=list)
    skipped_steps: int = 0
    stopping_reason: AlertKind | None = None
    stopping_reason_message: str | None = None
    ladder: Ladder = field(default_factory=Ladder)
    checks: dict[int, int] = field(default_factory=dict)

    @property
    def halted(self) -> bool:
        """Whether the run has halted (with ``min_steps`` Lightning trains on after ``should_stop``)."""
        return self.stopping_reason is not None

    def begin(self) -> None:
        """A run (or the same trainer's again) begins: it has not halted."""
        self.stopping_reason, self.stopping_reason_message = None, None

    def next_check(self, optimizer: int) -> int:
        """The number of ``optimizer``'s check being judged (0, 1, 2...), counted."""
        number = self.checks.get(optimizer, 0)
        self.checks[optimizer] = number + 1
        return number

    def halt(self, alert: Alert) -> None:
        """Record a halt: the first of the run is its reason."""
        if self.stopping_reason is None:
            self.stopping_reason, self.stopping_reason_message = alert.kind, alert.message

    def state_dict(self) -> dict[str, Any]:
        """The state as plain values."""
        return {
            "alerts": [a.to_dict() for a in self.alerts],
            "skipped_steps": self.skipped_steps,
            "stopping_reason": None if self.stopping_reason is None else self.stopping_reason.value,
            "stopping_reason_message": self.stopping_reason_message,
            "ladder": self.ladder.state_dict(),
            "checks": {str(i): n for i, n in self.checks.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the alerts, skipped steps and ladder (not the stopping reason: a resumed run has not halted)."""
        self.alerts = [Alert.from_dict(a) for a in state.get("alerts", [])]
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.ladder = Ladder.from_state(state["ladder"]) if "ladder" in state else Ladder()
        self.checks = {int(i): int(n) for i, n in state.get("checks", {}).items()}
