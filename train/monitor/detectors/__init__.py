"""The per-step detectors: they read the step's metrics (already reduced over ranks from sums
and counts) and keep short windows of their own. Window means of a modality's loss are
recomputed from sums and counts (``loss/<m>`` x ``tokens/<m>``), never as means of means, so
a modality that is absent from some steps is weighed by its tokens.

Each detector fires once when its condition starts and again only after it has cleared
(``_Latch``): a collapsed modality is one alarm, not one per step.

One module per detector: ``divergence``, ``collapse``, ``stagnation`` (with starvation),
``drift``, ``code_use``; ``common`` holds what they share (``_Latch``, ``ModalityWindows``,
``Levels``).
"""

from train.monitor.detectors.code_use import DataCodeUse
from train.monitor.detectors.collapse import Collapse
from train.monitor.detectors.common import Levels, ModalityWindows
from train.monitor.detectors.divergence import CONTENT, Divergence
from train.monitor.detectors.drift import Drift
from train.monitor.detectors.stagnation import Stagnation

__all__ = [
    "CONTENT",
    "Collapse",
    "DataCodeUse",
    "Divergence",
    "Drift",
    "Levels",
    "ModalityWindows",
    "Stagnation",
]
