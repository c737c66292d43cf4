"""Per-bucket timelines of the D-Lion exchange during whole training steps.

``Tracer`` records, on one rank, with ``time.perf_counter`` (CLOCK_MONOTONIC, the same clock in
every process of the host, so ranks line up):

- the step's phases (``mark``): step start, forward end, backward end, step end;
- each parameter's gradient becoming final (a post-accumulate-grad hook): the backward's own
  progress;
- the exchange's work on the rank's main thread (spans): ``Exchange.add`` (the hook's share of
  the backward, or DDP's comm hook), the kernel stages (non-finite scan, local step, tally,
  apply), every host wait for a collective (``collectives.wait``) and ``Exchange.finish``;
- every collective: when it was issued and, for asynchronous ones, when its ``Work`` completed
  (the callback of its future, run by the backend's thread as it finishes).

It patches the package's ``collectives.collective`` / ``wait`` where modules imported them, the
kernel stages (``backends.get``) and ``Exchange``'s ``add`` / ``finish``, so the library needs no
tracing code of its own; nothing changes what the step computes. ``plot`` draws one step of every
rank, one panel per path, on a shared time axis.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

STAGES = ("nonfinite", "local_step", "tally", "apply")


class Tracer:
    def __init__(self):
        self.events: list[dict] = []
        self.step = -1
        self._lock = threading.Lock()  # future callbacks run on the backend's threads

    # ------------------------------------------------------------------ recording

    def _add(self, event: dict) -> None:
        with self._lock:
            self.events.append(event)

    def mark(self, kind: str, **info) -> None:
        self._add(dict(kind=kind, t=time.perf_counter(), step=self.step, **info))

    @contextlib.contextmanager
    def span(self, kind: str, **info):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._add(dict(kind=kind, t=t0, end=time.perf_counter(), step=self.step, **info))

    def start_step(self, step: int) -> None:
        self.step = step
        self.mark("step_start")

    # ------------------------------------------------------------------ patches

    def watch_grads(self, params) -> list:
        """Record when each parameter's gradient is final; returns the hook handles."""
        return [p.register_post_accumulate_grad_hook(
            lambda _p, i=i: self.mark("grad", index=i)) for i, p in enumerate(params)]

    def install(self) -> None:
        """Patch the package (call before building any optimizer)."""
        from dlion_kernels.exchange import collectives, pipeline
        from dlion_kernels.kernels import backends

        tracer = self
        original_collective, original_wait = collectives.collective, collectives.wait

        def collective(name, step, fn, *args, **kwargs):
            t0 = time.perf_counter()
            work = original_collective(name, step, fn, *args, **kwargs)
            event = dict(kind="collective", name=name, t=t0, issued=time.perf_counter(),
                         step=tracer.step, sync=work is None)
            if work is None:  # ran to completion inside the call
                event["done"] = event["issued"]
            else:
                def finished(_fut, event=event):
                    event["done"] = time.perf_counter()

                work.get_future().add_done_callback(finished)
            tracer._add(event)
            return work

        def wait(work, step, name, *args, **kwargs):
            with tracer.span("wait", name=name):
                return original_wait(work, step, name, *args, **kwargs)

        for mod in list(sys.modules.values()):
            if not getattr(mod, "__name__", "").startswith("dlion_kernels"):
                continue
            for attr, value in list(vars(mod).items()):
                if value is original_collective:
                    setattr(mod, attr, collective)
                elif value is original_wait:
                    setattr(mod, attr, wait)

        real_get = backends.get

        class Stages:
            def __init__(self, inner):
                self._inner = inner

            def __getattr__(self, attr):
                fn = getattr(self._inner, attr)
                if attr not in STAGES:
                    return fn

                def traced(*args, **kwargs):
                    with tracer.span(attr):
                        return fn(*args, **kwargs)

                return traced

        backends.get = lambda name: Stages(real_get(name))

        for method in ("add", "finish"):
            original = getattr(pipeline.Exchange, method)

            def traced(self, *args, _original=original, _method=method, **kwargs):
                with tracer.span(_method):
                    return _original(self, *args, **kwargs)

            setattr(pipeline.Exchange, method, traced)

    def dump(self) -> list[dict]:
        with self._lock:
            return [dict(e) for e in self.events]


# ----------------------------------------------------------------------------- analysis


def step_events(events: list[dict], step: int) -> list[dict]:
    return [e for e in events if e["step"] == step]


def phases(events: list[dict]) -> dict:
    """Times of one step's marks on one rank: step_start, fwd_end, bwd_end, step_end."""
    return {e["kind"]: e["t"] for e in events if e["kind"] in (
        "step_start", "fwd_end", "bwd_end", "step_end")}


def bucket_table(events: list[dict]) -> list[dict]:
    """Per bucket of one step on one rank, times in ms from the backward's start: when its
    all_to_all was issued and done, its gather issued and done (collectives of one name are
    issued in bucket order), and the host waits that named it."""
    ph = phases(events)
    t0 = ph["fwd_end"]
    rows: dict[int, dict] = {}
    count: dict[str, int] = {}
    for e in sorted((e for e in events if e["kind"] == "collective"), key=lambda e: e["t"]):
        kind = "a2a" if e["name"].startswith("all_to_all") else (
            "gather" if e["name"] == "all_gather(aggregate)" else None)
        if kind is None:
            continue
        k = count.get(kind, 0)
        count[kind] = k + 1
        row = rows.setdefault(k, {"bucket": k})
        row[f"{kind}_issued_ms"] = 1e3 * (e["t"] - t0)
        row[f"{kind}_done_ms"] = 1e3 * (e.get("done", float("nan")) - t0)
    waits: dict[str, int] = {}
    for e in sorted((e for e in events if e["kind"] == "wait"), key=lambda e: e["t"]):
        kind = "a2a" if e["name"].startswith("all_to_all") else "gather"
        k = waits.get(kind, 0)
        waits[kind] = k + 1
        row = rows.setdefault(k, {"bucket": k})
        row[f"{kind}_wait_start_ms"] = 1e3 * (e["t"] - t0)
        row[f"{kind}_wait_ms"] = 1e3 * (e["end"] - e["t"])
    return [rows[k] for k in sorted(rows)]


def summary(events: list[dict]) -> dict:
    """One step on one rank, ms: forward, backward, step(); the main thread's time in the
    exchange during backward (hooks) split into stages and host waits; waits in step()."""
    ph = phases(events)
    fwd_end, bwd_end = ph["fwd_end"], ph["bwd_end"]

    def within(e, a, b):
        return a <= e["t"] < b

    def total(kind, a, b, name=None):
        return 1e3 * sum(e["end"] - e["t"] for e in events if e["kind"] == kind
                         and within(e, a, b) and (name is None or e.get("name") == name))

    out = {"fwd_ms": 1e3 * (fwd_end - ph["step_start"]), "bwd_ms": 1e3 * (bwd_end - fwd_end),
           "opt_ms": 1e3 * (ph["step_end"] - bwd_end),
           "bwd_hook_ms": total("add", fwd_end, bwd_end),
           "bwd_wait_ms": total("wait", fwd_end, bwd_end),
           "opt_wait_ms": total("wait", bwd_end, ph["step_end"])}
    for stage in STAGES:
        out[f"bwd_{stage}_ms"] = total(stage, fwd_end, bwd_end)
        out[f"opt_{stage}_ms"] = total(stage, bwd_end, ph["step_end"])
    grads = [e["t"] for e in events if e["kind"] == "grad"]
    if grads:
        out["first_grad_ms"] = 1e3 * (min(grads) - fwd_end)
        out["last_grad_ms"] = 1e3 * (max(grads) - fwd_end)
    a2a = [e for e in events if e["kind"] == "collective" and e["name"].startswith("all_to_all")]
    if a2a:
        out["first_a2a_issued_ms"] = 1e3 * (min(e["t"] for e in a2a) - fwd_end)
    return out


# ----------------------------------------------------------------------------- plot

COLORS = {"fwd": "#d9d9d9", "bwd": "#bdd7ee", "opt": "#fde9c9", "nonfinite": "#8c8c8c",
          "local_step": "#1f77b4", "tally": "#2ca02c", "apply": "#9467bd", "wait": "#d62728",
          "a2a": "#ff7f0e", "gather": "#17becf"}


def plot(panels: list[tuple[str, list[list[dict]]]], path: str, title: str) -> str | None:
    """``panels``: (name, [events of one step, per rank]). One panel per path, one band per
    rank: the step's phases, the main thread's exchange work (stages, host waits in red), the
    gradient-ready ticks (backward's progress) and, below, each collective from issue to done
    (one lane per bucket, all_to_all orange, gather cyan). Time from the step's start on the
    earliest rank."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 3.2 * len(panels) + 0.8),
                             squeeze=False, sharex=True)
    for ax, (name, ranks) in zip(axes[:, 0], panels):
        t0 = min(phases(ev)["step_start"] for ev in ranks)
        ms = lambda t: 1e3 * (t - t0)  # noqa: E731
        labels = []
        y = 0.0
        for rank, ev in reversed(list(enumerate(ranks))):
            ph = phases(ev)
            buckets = bucket_table(ev)
            lanes = max(1, len(buckets))
            # collectives: one thin lane per bucket
            count: dict[str, int] = {}
            for e in sorted((e for e in ev if e["kind"] == "collective"), key=lambda e: e["t"]):
                kind = "a2a" if e["name"].startswith("all_to_all") else (
                    "gather" if e["name"] == "all_gather(aggregate)" else "other")
                k = count.get(kind, 0)
                count[kind] = k + 1
                lane = y + 0.08 + 0.8 * (k % lanes) / lanes
                done = e.get("done", e["issued"])
                ax.broken_barh([(ms(e["t"]), max(ms(done) - ms(e["t"]), 0.3))],
                               (lane, 0.8 / lanes * 0.8), color=COLORS.get(kind, "k"),
                               alpha=0.9)
            labels.append((y + 0.5, f"rank {rank}\ncollectives"))
            y += 1.0
            # the main thread: phases behind, exchange work in front
            spans = [("fwd", ph["step_start"], ph["fwd_end"]),
                     ("bwd", ph["fwd_end"], ph["bwd_end"]), ("opt", ph["bwd_end"], ph["step_end"])]
            for kind, a, b in spans:
                ax.broken_barh([(ms(a), ms(b) - ms(a))], (y + 0.05, 0.9), color=COLORS[kind])
            for e in ev:
                if e["kind"] in STAGES or e["kind"] == "wait":
                    ax.broken_barh([(ms(e["t"]), max(ms(e["end"]) - ms(e["t"]), 0.2))],
                                   (y + 0.3, 0.4), color=COLORS[e["kind"]])
                elif e["kind"] == "grad":
                    ax.plot([ms(e["t"])] * 2, [y + 0.75, y + 0.95], color="k", lw=0.6)
            labels.append((y + 0.5, f"rank {rank}\nmain thread"))
            y += 1.25
        ax.set_yticks([p for p, _ in labels])
        ax.set_yticklabels([t for _, t in labels], fontsize=7)
        ax.set_ylim(-0.1, y)
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms from the step's start (earliest rank)")
    handles = [Patch(color=COLORS[k], label=lab) for k, lab in (
        ("fwd", "forward"), ("bwd", "backward"), ("opt", "opt.step()"),
        ("local_step", "local step"), ("tally", "tally"), ("apply", "apply"),
        ("nonfinite", "non-finite scan"), ("wait", "host wait for a collective"),
        ("a2a", "all_to_all issued..done"), ("gather", "all_gather issued..done"))]
    fig.suptitle(title, fontsize=9, y=0.995)
    fig.legend(handles=handles, loc="upper center", ncol=5, fontsize=7,
               bbox_to_anchor=(0.5, 0.965))
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
