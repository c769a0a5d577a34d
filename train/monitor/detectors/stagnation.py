"""``Stagnation``: one modality stops improving while the others improve, or is starved of tokens."""

from __future__ import annotations

import math
from collections import deque

from data.vocab import MODALITY_NAMES
from train.monitor.alarms import Alarm
from train.monitor.config import StagnationConfig
from train.monitor.detectors.common import ModalityWindows, _Latch

# beside a held-out evaluation's losses: whether it covered every batch, and how many it read
COMPLETE, BATCHES = "complete", "batches"
NO_HELDOUT = "the rule checks them itself in a run with data.validation and train.eval_every > 0"


def _change(losses: dict[str, float], base: dict[str, float], name: str) -> float | None:
    """The relative change of ``name``'s held-out loss from ``base`` to ``losses``; None
    without a finite figure in both."""
    now, before = losses.get(name), base.get(name)
    if now is None or before is None or not (math.isfinite(now) and math.isfinite(before)):
        return None
    return now / before - 1 if before > 0 else None


def _comparable(base: dict[str, float], losses: dict[str, float]) -> bool:
    """Whether two evaluations read the same documents: both the whole held-out set, or as many
    of its batches (``train.eval_batches`` cuts the pass short; a resume may change it, or the
    world size that splits the batches)."""
    if base.get(COMPLETE, 1.0) == 1.0 and losses.get(COMPLETE, 1.0) == 1.0:
        return True
    return base.get(COMPLETE) == losses.get(COMPLETE) and base.get(BATCHES) == losses.get(BATCHES)


def _missing(name: str, own: float | None, losses: dict[str, float]) -> str:
    """Why an evaluation could not judge ``name``'s alarm."""
    what = name if own is None else "other modality judged"
    why = f"the held-out evaluations have no finite loss of any {what}"
    if losses.get(COMPLETE, 1.0) < 1:
        why += " in the batches train.eval_batches lets them read (0: all of them)"
    return why


class Stagnation:
    """One modality stops improving (or gets worse) against its own trailing window while the
    others still improve: the symptom of modality competition or starvation in early fusion.

    Robust to a batch mix that swings: window means weigh steps by their tokens of the modality,
    a window needs ``min_tokens`` of them spread over at least ``min_presence`` of its steps (a
    modality that arrives in bursts, one long document filling a few batches, changes with the
    document, not with the model), and the difference between this modality's change and the
    others' must exceed ``z`` standard errors (estimated from the steps' own spread). Structure markers are left out
    (learned in a few steps, they would make every other modality look slow), and the condition
    must hold for ``patience`` consecutive steps. A window is judged only when its tokens came from
    at least ``min_docs`` documents of the modality, counted by their tokens (``documents``;
    from the loader's pieces table): over a few long files the loss follows each file's
    difficulty, and no spread of its steps measures that. Nor is it judged when the modality's
    data changed difficulty between the windows (the unigram CE of its tokens, ``unigram/<m>``,
    moved by more than ``max_data_shift``), nor until two windows have passed since it did: the
    loss then follows the data.

    The training losses cannot tell all of that from a stall: a stretch of easy files lowers the
    window before, and a small source repeated many times keeps the others' training loss
    falling while it is learnt by heart. In a run that evaluates held-out data every
    ``heldout_every`` steps, an alarm therefore waits for the next evaluation and is raised only
    if the modality's held-out loss fell by less than ``heldout_drop`` since the evaluation
    before the trouble began (with none that early, the first after) and lagged the others' by
    more; otherwise it is logged (action ``log``) with the held-out figures."""

    SKIP = ("structure",)

    def __init__(self, cfg: StagnationConfig, heldout_every: int = 0) -> None:
        self.cfg = cfg
        self.heldout_every = heldout_every  # train.eval_every of a run with held-out data, else 0
        # The held-out losses of recent evaluations, (step, {modality: loss}): the newest one
        # from before any trouble that can still begin, and those after it.
        self.heldout: list[tuple[int, dict[str, float]]] = []
        # modality -> an alarm the training losses raised, waiting for the held-out losses
        self.pending: dict[str, dict] = {}
        self.win = ModalityWindows(cfg.window)
        self.data = ModalityWindows(cfg.window, key="unigram/")  # the data's own difficulty
        self.moved: dict[str, int] = {}  # modality -> the last step its data's difficulty moved
        self.streak: dict[str, int] = {}
        self.share_best: dict[str, float] = {}
        self.latch = _Latch()
        # per modality, (documents new to it, their token mass's increase, its tokens) in each
        # of the last 2 x window steps (None: the step's metrics did not say, and the window is
        # judged on its tokens alone)
        self.docs: dict[str, deque] = {
            name: deque(maxlen=2 * cfg.window) for name in MODALITY_NAMES
        }

    def _add_docs(self, metrics: dict) -> None:
        for name in MODALITY_NAMES:
            begun = metrics.get(f"data/docs_new/{name}")
            mass = float(metrics.get(f"data/docs_mass/{name}", 0.0))
            tokens = float(metrics.get(f"tokens/{name}", 0.0))
            self.docs[name].append(None if begun is None else (float(begun), mass, tokens))

    def documents(self, name: str, recent: bool = True) -> float | None:
        """The documents of ``name`` that one window's tokens came from, counted by their
        tokens: those new to it in the window's steps plus the one under way when it opened (a
        long file spans windows), or, when fewer, as many equally long documents as would hold
        the window's tokens with the documents' token mass (train/tasks/documents.py: one long
        file with a caption or two beside it is about one document); None when a step did not
        say."""
        steps = list(self.docs[name])
        if len(steps) < (self.cfg.window if recent else 2 * self.cfg.window):
            return None  # not yet two windows
        part = steps[-self.cfg.window :] if recent else steps[: -self.cfg.window]
        if not part or any(entry is None for entry in part):
            return None
        begun, mass, tokens = (sum(column) for column in zip(*part))
        count = 1.0 + begun
        return min(count, max(1.0, tokens**2 / mass)) if mass > 0 else count

    def _note_moves(self, step: int) -> None:
        """The modalities whose data changed difficulty: the unigram CE of their tokens over the
        newest half window differs by more than ``max_data_shift`` from the window before (the
        newest half, not the whole window: a move that builds over tens of steps shows there
        first, before the loss it raises has fired the rule)."""
        if not self.cfg.max_data_shift:
            return  # 0: off
        for name in MODALITY_NAMES:
            data = self.data.mean(name, newest=self.cfg.window // 2), self.data.mean(name, False)
            if data[0] and data[1] and abs(data[0] / data[1] - 1) > self.cfg.max_data_shift:
                self.moved[name] = step

    def _moving(self, name: str, step: int) -> bool:
        """Whether ``name``'s data moved within the last two windows: until both windows hold
        data from after the move, the window before still straddles it."""
        return step - self.moved.get(name, -(10**9)) < 2 * self.cfg.window

    def _changes(self, step: int, metrics: dict) -> dict[str, tuple[float, float, float]]:
        """modality -> (relative change of its windowed loss, its standard error, tokens)."""
        out = {}
        for name in MODALITY_NAMES:
            if name in self.SKIP:
                continue
            block = self.cfg.block_steps
            now = self.win.stats(name, block=block)
            before = self.win.stats(name, recent=False, block=block)
            if now is None or before is None or before[0] <= 0:
                continue
            if min(now[2], before[2]) < self.cfg.min_tokens:
                continue
            if min(now[3], before[3]) < self.cfg.min_presence:
                continue  # a modality that comes in bursts (one long document at a time)
            docs = [self.documents(name, recent) for recent in (True, False)]
            if any(count is not None and count < self.cfg.min_docs for count in docs):
                continue  # a few long files: the loss follows their difficulty, not the model
            if self._moving(name, step):
                continue  # the data got easier or harder: the loss follows it
            # Within max_data_shift the data's difficulty still moves the loss as much: the
            # change is taken against it (the loss over the unigram CE of the same tokens; 1
            # without a unigram, a run on raw shards)
            data = self.data.mean(name), self.data.mean(name, recent=False)
            harder = data[0] / data[1] if data[0] and data[1] else 1.0
            ratio = now[0] / before[0] / harder
            change = ratio - 1
            std_err = ratio * math.hypot(now[1] / max(now[0], 1e-9), before[1] / before[0])
            out[name] = (change, std_err, now[2])
            metrics[f"monitor/trend/{name}"] = change  # of the windowed loss, for its data
        return out

    def _starved(self, step: int, metrics: dict) -> list[Alarm]:
        """A modality whose share of the tokens fell to ``starve_ratio`` of its highest share
        over earlier windows: the mix shifted (a source changed content, a weight was changed)
        and it is being starved, whatever its loss does yet."""
        cfg = self.cfg
        parts = {
            modality: self.win.part(modality)
            for modality in MODALITY_NAMES
            if modality not in self.SKIP
        }
        if any(part is None for part in parts.values()):
            return []
        tokens = {
            modality: sum(count for _, count in part or []) for modality, part in parts.items()
        }
        presence = {
            modality: sum(1 for _, count in part or [] if count) / cfg.window
            for modality, part in parts.items()
        }
        total = sum(tokens.values())
        out = []
        for name, count in tokens.items():
            if not total:
                break
            share = count / total
            metrics[f"monitor/share/{name}"] = share
            best = self.share_best.get(name, 0.0)
            steady = presence[name] >= cfg.min_presence  # a bursty modality has no steady share
            low = (
                steady
                and step >= cfg.min_steps
                and best >= 0.05
                and share < cfg.starve_ratio * best
            )
            key = f"share/{name}"
            self.streak[key] = self.streak.get(key, 0) + 1 if low else 0
            if steady and step >= cfg.min_steps and (step - cfg.min_steps) % cfg.window == 0:
                self.share_best[name] = max(best, share)  # one sample per window
            # Half the patience: a share is a count, far less noisy than a loss.
            firing = self.streak[key] >= max(1, cfg.patience // 2)
            if self.latch.edge(key, firing, step - cfg.window - cfg.patience // 2):
                out.append(
                    Alarm(
                        step,
                        "starvation",
                        cfg.action,
                        modality=name,
                        since=step - cfg.window - cfg.patience // 2,
                        values={"share": share, "best_share": best},
                        message=f"{name} gets {share:.0%} of the tokens over the last {cfg.window} "
                        f"steps, down from {best:.0%}",
                        threshold=f"token share < {cfg.starve_ratio:g} x its highest window share "
                        f"for {cfg.patience // 2} steps, present in >= {cfg.min_presence:.0%} of them",
                        cause=f"the delivered mix shifted away from {name}: a source's content "
                        "changed, or the weights did; its learning stalls or reverses",
                        advice="compare mix/<source> and tokens/<modality> with data.sources' "
                        f"weights; restore {name}'s share if the shift was not meant",
                    )
                )
        return out

    def check(self, step: int, metrics: dict) -> list[Alarm]:
        cfg = self.cfg
        self.win.add(metrics)
        self.data.add(metrics)
        self._note_moves(step)
        self._add_docs(metrics)
        changes = self._changes(step, metrics)
        out = self._starved(step, metrics) + self._add_heldout(step, metrics)
        for name in MODALITY_NAMES:
            if name not in changes:  # not judged this step: the steps in a row start again
                self.streak[name] = 0
                self.latch.edge(name, False)
        for name, (change, std_err, _) in changes.items():
            others = {other: other_stats for other, other_stats in changes.items() if other != name}
            tokens = sum(other_stats[2] for other_stats in others.values())
            if not others or not tokens:
                self.streak[name] = 0
                continue
            others_change = (
                sum(other_stats[0] * other_stats[2] for other_stats in others.values()) / tokens
            )
            others_se = (
                math.sqrt(
                    sum((other_stats[1] * other_stats[2]) ** 2 for other_stats in others.values())
                )
                / tokens
            )
            gap = change - others_change
            cond = (
                step >= cfg.min_steps
                and change >= -cfg.min_drop
                and others_change <= -cfg.others_drop
                and gap > cfg.z * math.hypot(std_err, others_se)
            )
            self.streak[name] = self.streak.get(name, 0) + 1 if cond else 0
            since = step - cfg.window - cfg.patience
            if self.latch.edge(name, self.streak[name] >= cfg.patience, since):
                found = {
                    "step": step,
                    "since": since,
                    "change": change,
                    "others_change": others_change,
                    "z": gap / max(math.hypot(std_err, others_se), 1e-12),
                    "others": {other: float(stats[2]) for other, stats in others.items()},
                }
                out += self._raise(name, found)
        return out + self._check_waiting(step)

    # --- confirmation on the held-out losses ------------------------------------------------------
    def _raise(self, name: str, found: dict) -> list[Alarm]:
        """An alarm now, or one that waits for the held-out losses of the next evaluation."""
        if not self.heldout_every:
            return [self._alarm(found["step"], name, found, why=NO_HELDOUT)]
        # The reference: the newest evaluation from before the trouble began, else the first
        # since, else (None) the next one
        before = [evaluation for evaluation in self.heldout if evaluation[0] <= found["since"]]
        base = before[-1] if before else self.heldout[0] if self.heldout else None
        found["base"] = list(base) if base else None
        if name in self.pending:
            return []  # the first stands until judged
        self.pending[name] = found
        if base and base[0] < found["step"] == self.heldout[-1][0]:
            return self._judge(found["step"], self.heldout[-1][1], only=name)  # evaluated now
        return []

    def _add_heldout(self, step: int, metrics: dict) -> list[Alarm]:
        """Takes an evaluation's held-out losses (``val/loss/<m>``, in the metrics of its step)
        and judges the alarms waiting for them."""
        losses = {
            name: float(metrics[f"val/loss/{name}"])
            for name in MODALITY_NAMES
            if f"val/loss/{name}" in metrics
        }
        if not losses or (self.heldout and self.heldout[-1][0] >= step):
            return []  # none, or the step's evaluation again (a run whose data ends on one)
        losses[COMPLETE] = float(metrics.get("val/complete", 1.0))
        losses[BATCHES] = float(metrics.get("val/batches", 0.0))
        self.heldout.append((step, losses))
        # a trouble beginning from now on begins after this horizon: older evaluations, but the
        # newest of them, can no longer be anyone's reference
        horizon = step - self.cfg.window - self.cfg.patience
        while len(self.heldout) > 1 and self.heldout[1][0] <= horizon:
            self.heldout.pop(0)
        return self._judge(step, losses)

    def _judge(self, step: int, losses: dict[str, float], only: str | None = None) -> list[Alarm]:
        """The waiting alarms judged on the evaluation of ``step``. One the held-out losses do
        not confirm is logged once and waits on, judged again at each evaluation (from the one
        it was judged at) for as long as the training losses' condition holds."""
        out = []
        for name, found in list(self.pending.items()):
            if only not in (None, name):
                continue
            if found["base"] is None:
                found["base"] = [step, losses]
                continue
            base_step, base = found["base"]
            if not _comparable(base, losses):
                found["base"] = [step, losses]  # other documents: this one is the reference
                continue
            own = _change(losses, base, name)
            others = {
                other: (change, tokens)
                for other, tokens in found["others"].items()
                if (change := _change(losses, base, other)) is not None
            }
            weight = sum(tokens for _, tokens in others.values())
            if own is None or not weight:
                del self.pending[name]
                out.append(self._alarm(step, name, found, why=_missing(name, own, losses)))
                continue
            others_change = sum(change * tokens for change, tokens in others.values()) / weight
            drop = self.cfg.heldout_drop
            if own > -drop and own - others_change > drop:
                del self.pending[name]
                out.append(self._alarm(step, name, found, held=(own, others_change, base_step)))
                continue
            if not found.get("logged"):
                out.append(
                    self._alarm(step, name, found, held=(own, others_change, base_step), log=True)
                )
            if name in self.latch.on:  # the condition holds: judged again at the next one
                found.update(base=[step, losses], logged=True)
            else:
                del self.pending[name]
        return out

    def _check_waiting(self, step: int) -> list[Alarm]:
        """The alarms that can wait no longer, raised as the training losses found them: the run
        evaluates no held-out data any more (a resume without it), or none came in twice
        ``heldout_every`` steps (from when it was found, or from its reference where an
        evaluation of other documents moved that on). One already logged stops waiting when its
        condition ends."""
        out = []
        for name, found in list(self.pending.items()):
            since = max(found["step"], found["base"][0]) if found["base"] else found["step"]
            if found.get("logged"):
                if name not in self.latch.on or not self.heldout_every:
                    del self.pending[name]
            elif not self.heldout_every or step - since > 2 * self.heldout_every:
                why = (
                    NO_HELDOUT if not self.heldout_every else "no held-out evaluation came in time"
                )
                out.append(self._alarm(step, name, self.pending.pop(name), why=why))
        return out

    def flush(self, step: int, why: str) -> list[Alarm]:
        """The waiting alarms raised now, as the training losses found them, ``why`` no held-out
        evaluation judges them (the run ends, or goes back over the steps they waited in); those
        the held-out losses did not confirm are dropped."""
        out = [
            self._alarm(step, name, found, why=why)
            for name, found in self.pending.items()
            if not found.get("logged")
        ]
        self.pending.clear()
        return out

    def finish(self, step: int, final: dict) -> list[Alarm]:
        """The run's end: its last evaluation (``final``, the metrics of final.json) judges what
        waits for it; what still waits is raised as the training losses found it."""
        out = self._add_heldout(step, final)
        return out + self.flush(step, "no held-out evaluation came after its reference")

    def _alarm(
        self,
        step: int,
        name: str,
        found: dict,
        *,
        held: tuple[float, float, int] | None = None,
        log: bool = False,
        why: str = "",
    ) -> Alarm:
        """The alarm for ``found`` (the training losses' evidence): raised, or only logged
        (``log``), on the held-out losses (``held``: the modality's relative change, the
        others', the reference step) or, without them, for ``why``."""
        cfg = self.cfg
        change, others_change = found["change"], found["others_change"]
        word = "rose" if change > 0 else "stalled"
        values = {"change": change, "others_change": others_change, "z": found["z"]}
        message = (
            f"{name} loss {word} ({change:+.1%} over {cfg.window} steps, for its data's "
            f"difficulty, for {cfg.patience} steps running) while the other modalities fell "
            f"{-others_change:.1%}"
        )
        threshold = (
            f"change >= {-cfg.min_drop:+.0%} while the others fall >= {cfg.others_drop:.0%}, "
            f"{cfg.z:g} standard errors apart, for {cfg.patience} steps"
        )
        if held is not None:
            own, others, base_step = held
            values.update(heldout_change=own, heldout_others_change=others, heldout_from=base_step)
            message += (
                f"; held out, val/loss/{name} {own:+.1%} from step {base_step} to {step}, the "
                f"others' {others:+.1%}"
            )
            threshold += (
                f"; on held-out data, fell < {cfg.heldout_drop:.0%} and lagged the others' by "
                f"> {cfg.heldout_drop:.0%} (heldout_drop)"
            )
        if log:
            assert held is not None
            if held[0] > -cfg.heldout_drop:  # it did not fall, nor lag the others' by more
                cause = (
                    f"the held-out {name} loss did not fall, but the others' did not fall faster "
                    f"(by more than {cfg.heldout_drop:.0%}): no modality learns its held-out "
                    f"data, which is learning the training documents by heart, not {name} "
                    "losing to the others"
                )
                advice = (
                    "compare val/loss/<m> with val/unigram/<m>: more documents, fewer steps or a "
                    "smaller model; judged again at the next evaluation while it lasts"
                )
            else:
                cause = (
                    f"the held-out {name} loss fell: the training loss followed which documents "
                    "filled its windows, or the others' fall was a small source learnt by heart"
                )
                advice = (
                    f"nothing for {name}; judged again at the next evaluation while the "
                    "training losses still say so"
                )
            return Alarm(
                step,
                "stagnation",
                "log",  # recorded in alarms.jsonl, not raised
                modality=name,
                since=found["since"],
                values=values,
                message=f"not raised: {message}",
                threshold=threshold,
                cause=cause,
                advice=advice,
            )
        if held is not None:
            cause = (
                f"{name} is losing the competition for the model's capacity or is starved of "
                f"tokens (tokens/{name}, mix/<source>); the held-out losses confirm it"
            )
            advice = (
                f"check the delivered mix (mix/<source>, tokens/{name}) against the weights, "
                "then raise its weight or the model's capacity"
            )
        else:
            cause = (
                f"{name} is losing the competition for the model's capacity or is starved of "
                f"tokens (tokens/{name}, mix/<source>), or its data changed; on a small corpus "
                "the others' fall can be a small source memorised (repeated many times: its "
                "training loss falls, its held-out loss not)"
            )
            advice = (
                f"if its held-out loss falls as the others' do, the training loss followed its "
                f"files; if not, check the delivered mix (mix/<source>, tokens/{name}) against "
                f"the weights, then raise its weight or the model's capacity (not checked on "
                f"held-out losses: {why})"
            )
        return Alarm(
            step,
            "stagnation",
            cfg.action,
            modality=name,
            since=found["since"],
            values=values,
            message=message,
            threshold=threshold,
            cause=cause,
            advice=advice,
        )

    def state_dict(self) -> dict:
        return {
            "win": self.win.state_dict(),
            "data": self.data.state_dict(),
            "moved": self.moved,
            "streak": self.streak,
            "share_best": self.share_best,
            "latch": self.latch.state_dict(),
            "docs": {name: list(counts) for name, counts in self.docs.items()},
            "heldout": [[step, dict(losses)] for step, losses in self.heldout],
            "pending": {name: dict(found) for name, found in self.pending.items()},
        }

    def load_state_dict(self, st: dict) -> None:
        self.win.load_state_dict(st["win"])
        self.data.load_state_dict(st["data"])
        self.moved = {key: int(value) for key, value in st["moved"].items()}
        self.streak = dict(st["streak"])
        self.share_best = {key: float(value) for key, value in st["share_best"].items()}
        self.latch.load_state_dict(st["latch"])
        for name, counts in st["docs"].items():
            self.docs[name] = deque(
                (None if entry is None else tuple(entry) for entry in counts),
                maxlen=2 * self.cfg.window,
            )
        self.heldout = [(int(step), dict(losses)) for step, losses in st["heldout"]]
        self.pending = {name: dict(found) for name, found in st["pending"].items()}
