"""Per-modality monitors: detectors, probes and alarms (docs/monitors.md)."""

from train.monitor.alarms import Alarm, AlarmLog, strongest
from train.monitor.config import ACTIONS, MonitorConfig
from train.monitor.monitor import Monitor, chance_levels

__all__ = ["ACTIONS", "Alarm", "AlarmLog", "Monitor", "MonitorConfig", "chance_levels", "strongest"]
