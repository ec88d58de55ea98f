"""c2w command line. Thin: parse, call the library, print. User errors -> one line, exit code 2."""
from __future__ import annotations

import functools
import logging
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from c2w.runtime.errors import C2WUserError

# rich_markup_mode=None: the plain help. Typer's rich help prints a type label on every option,
# `<bool>` on each flag included (--help too), which reads as if the flag took a value.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Ahead-of-time engines for the MiniCPM-o 4.5 Code2Wav stage.")
console = Console()
err = Console(stderr=True)


def user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except C2WUserError as e:
            # the message is text, not markup: `c2w[plot]` must print as written
            err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
    return wrapper


def _quiet(verbose: bool) -> None:
    """Keep third-party exporter chatter (torch.onnx registration notes, ORT constant-folding
    notices, deprecation warnings) out of the user's terminal unless --verbose."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING)
    if verbose:
        return
    import warnings
    warnings.filterwarnings("ignore")
    for name in ("torch.onnx", "torch._dynamo", "torch._inductor", "torch.export", "onnxscript"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import onnxruntime
        onnxruntime.set_default_logger_severity(3)
    except ImportError:
        pass


def _int_list(option: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
        if values and min(values) >= 1:
            return values
    except ValueError:
        pass
    raise C2WUserError(option, repr(text), "comma-separated positive integers, e.g. 1,2,4,8")


def _parse_shard(s: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in s.split("/"))
        if 1 <= k <= n:
            return k, n
    except ValueError:
        pass
    raise C2WUserError("--shard", repr(s), "K/N with 1 <= K <= N, e.g. 2/8")


@app.command()
def version():
    """Print c2w, torch and backend versions."""
    import importlib.metadata as md
    import torch
    console.print(f"c2w {md.version('c2w') if _installed() else 'dev'}  torch {torch.__version__}")
    for mod in ("onnxruntime", "tensorrt"):
        try:
            console.print(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            console.print(f"{mod} not installed")


def _installed() -> bool:
    import importlib.metadata as md
    try:
        md.version("c2w")
        return True
    except md.PackageNotFoundError:
        return False


def _load(profile: str, backend: Optional[str], model: Optional[str]):
    from c2w.exporter.profile import load_profile
    return load_profile(profile).with_overrides(backend=backend, model=model)


@app.command()
@user_errors
def plan(profile: str = typer.Option(..., "--profile", "-p", help="profile YAML or bundled name (cpu, h100, h200)"),
         backend: Optional[str] = typer.Option(None, help="override the profile's backend"),
         model: Optional[str] = typer.Option(None, help="override the profile's model spec")):
    """Print the exact keys the profile's streams hit, their estimates and the budget cut; with a
    traffic section, each key's expected calls and saved ms, and the predicted engine hit rate."""
    from c2w.exporter.plan import dims_str, make_plan, precision_weights
    from c2w.runtime.model.weights import load_model
    p = _load(profile, backend, model)
    m = load_model(p.model)
    pl = make_plan(m.cfg, p, precision_weights(m, p))
    console.print(f"profile [bold]{p.name}[/] ({p.source}, digest {p.digest}), model {p.model} (digest {m.digest}), "
                  f"backend {p.backend}, budget {p.budget_bytes / 2**20:.0f} MiB", highlight=False, soft_wrap=True)
    for c, w in pl.weight_bytes.items():
        console.print(f"  weights {c}: {w / 2**20:.1f} MiB (once)")
    if pl.prediction:
        console.print("  in order of expected ms saved per byte; calls: per session; saved: ms per call")
    for e in pl.entries:
        mark = "build" if e.selected else "skip (budget)"
        use = "" if e.calls_per_session is None else \
            f"calls {e.calls_per_session:7.3f}  saved {e.saved_ms_per_call:9.3f}  "
        typer.echo(f"  {e.key.component:12s} {dims_str(e.key):28s} {e.key.dtype:8s} {e.category:6s} "
                   f"est {e.est_bytes / 2**20:8.1f} MiB  {use}{mark}")
    console.print(f"{len(pl.selected)} keys to build, {len(pl.skipped)} skipped by budget; planned total "
                  f"{pl.planned_total() / 2**20:.1f} MiB of {p.budget_bytes / 2**20:.0f} MiB")
    if pl.prediction:
        new, old = pl.prediction, pl.baseline
        console.print(f"traffic: predicted engine hit rate {new.hit_rate:.1%} of {new.calls_per_session:.1f} unit "
                      f"calls per session, {new.saved_ms_per_session:.1f} ms saved per session (priority order: "
                      f"{old.hit_rate:.1%}, {old.saved_ms_per_session:.1f} ms)", highlight=False, soft_wrap=True)
        console.print(f"timings: {pl.timing_source}", highlight=False, soft_wrap=True)
    for n in pl.notes:
        console.print(f"note: {n}")


@app.command()
@user_errors
def export(profile: str = typer.Option(..., "--profile", "-p", help="profile YAML or bundled name (cpu, h100, h200)"),
           out: Optional[Path] = typer.Option(None, help="artifact directory (default artifacts/<profile name>)"),
           backend: Optional[str] = typer.Option(None, help="override the profile's backend"),
           model: Optional[str] = typer.Option(None, help="override the model spec: checkpoint dir or random:full|tiny"),
           shard: str = typer.Option("1/1", help="build only shard K of N of the selected keys"),
           measure_at_merge: bool = typer.Option(False, "--measure-at-merge",
                                                 help="with --shard, for parallel shards on one GPU: keep built keys "
                                                      "by their estimates; c2w merge measures the memory"),
           dry_run: bool = typer.Option(False, "--dry-run", help="plan (and for tensorrt: check the ONNX graphs) only"),
           threads: Optional[int] = typer.Option(None, help="PyTorch threads of this process (default: 1 for a cuda "
                                                 "profile, so that many shards on one machine do not oversubscribe "
                                                 "its cores; one per core for a cpu profile)"),
           verbose: bool = typer.Option(False, "--verbose", "-v")):
    """Export every selected key of the profile as a verified exact-shape artifact."""
    from c2w.exporter.export import ExportInterrupted, dry_run_summary, export_profile
    from c2w.exporter.report import render
    _quiet(verbose)
    p = _load(profile, backend, model)
    out = out or Path("artifacts") / p.name
    shard_k_n = _parse_shard(shard)
    if measure_at_merge and shard_k_n[1] == 1:
        raise C2WUserError("--measure-at-merge", f"with --shard {shard}", "a sharded export (--shard K/N, N > 1)",
                           "Leave it out: an export that is not sharded measures its own keys.")
    if dry_run:
        console.print(dry_run_summary(p, out), highlight=False, soft_wrap=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(f"export {p.name} ({p.backend})", total=None)

        t0 = time.perf_counter()

        def progress(doing: str, i: int, n: int):
            bar.update(task, total=n, completed=i, description=doing)
            if not console.is_terminal:         # a CI log or a file: one line per step instead of the bar
                console.print(f"[{time.perf_counter() - t0:7.1f} s] {i}/{n} {doing}", highlight=False,
                              markup=False, soft_wrap=True)
        try:
            res = export_profile(p, out, dry_run=dry_run, shard=shard_k_n, measure=not measure_at_merge,
                                 on_progress=progress, threads=threads)
        except ExportInterrupted as e:
            bar.stop()
            err.print(str(e), highlight=False, markup=False)
            raise typer.Exit(130) from None
        bar.update(task, completed=bar.tasks[0].total or 0, description="done")
    if res.findings:
        from c2w.exporter.trt_check import format_findings
        console.print(format_findings(res.findings), highlight=False)
    if dry_run:
        from c2w.exporter.trt_check import errors
        console.print(f"dry run: {len(res.plan.selected)} keys would be built into {out}")
        raise typer.Exit(1 if errors(res.findings) else 0)
    console.print(render(res.manifest), highlight=False, soft_wrap=True)
    console.print(f"{res.built} built, {res.reused} reused, {res.over_budget} over budget, {res.failed} failed -> "
                  f"{out / 'manifest.json'}", highlight=False)
    if res.measure_error:
        err.print(f"error: {res.measure_error}", highlight=False, markup=False)
    raise typer.Exit(res.exit_code)


@app.command()
@user_errors
def report(out: Path = typer.Argument(..., help="artifact directory"),
           format: str = typer.Option("table", "--format", "-f", help="table | markdown | json"),
           plot: Optional[Path] = typer.Option(None, help="write a PNG: memory per key against the budget")):
    """Show which shapes got an engine, what each costs, and what the budget left to eager."""
    from c2w.exporter import report as rep
    from c2w.runtime.manifest import read_manifest
    if format not in rep.FORMATS:
        raise C2WUserError("--format", repr(format), f"one of {list(rep.FORMATS)}")
    m = read_manifest(out)
    typer.echo(rep.render(m, format))
    if plot:
        console.print(f"plot written to {rep.plot(m, plot)}")


@app.command()
@user_errors
def verify(out: Path = typer.Argument(..., help="artifact directory"),
           device: Optional[str] = typer.Option(None, help="cpu or cuda (default: the manifest's)")):
    """Re-run parity of every built artifact against eager, then check the budget (as recorded, and
    measured again in a fresh process); exit 1 on any failure."""
    from c2w.exporter.verify import verify_budget, verify_directory
    from c2w.runtime.manifest import Status
    manifest, checked = verify_directory(out, device)
    bad = 0
    for e in checked:
        p = e.parity          # None: the file check failed before parity ran
        worst = max(p.rel_l2.values(), default=float("nan")) if p is not None else float("nan")
        ok = e.status == Status.BUILT
        bad += not ok
        console.print(f"{'ok  ' if ok else 'FAIL'} {e.id}  worst rel-L2 {worst:.2e} (tol {p.tol if p is not None else '-'})"
                      + ("" if ok else f"  {e.error}"), highlight=False, markup=False)
    console.print(f"{len(checked) - bad}/{len(checked)} artifacts pass")
    if bad:                         # the runtime would not load them all: measuring them together says nothing
        console.print("budget: not measured (fix the failing artifacts first)")
        raise typer.Exit(1)
    budget = verify_budget(out, manifest, device)
    for line in budget.lines:
        console.print(f"budget: {line}", highlight=False, markup=False, soft_wrap=True)
    for problem in budget.problems:
        console.print(f"FAIL {problem}", highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(1 if budget.problems else 0)


@app.command()
@user_errors
def merge(out: Path = typer.Argument(..., help="merged artifact directory"),
          shards: list[Path] = typer.Argument(..., help="artifact directories of `c2w export --shard K/N` jobs")):
    """Combine the artifact directories of sharded export jobs into one."""
    from c2w.exporter.budget import mib
    from c2w.exporter.merge import merge_dirs
    from c2w.runtime.manifest import Measurement, Status

    def measured(i, n, e, ledger):          # a merge of unmeasured shards loads every key: minutes on a GPU
        what = "kept" if e.status == Status.BUILT else "over budget"
        console.print(f"measured {i + 1}/{n} {e.id}: {mib(e.device_bytes)} MiB, loaded and run in "
                      f"{e.extra['load_seconds']:.1f} s, {what}; {len(ledger.kept)} kept, {mib(ledger.total())} of "
                      f"{mib(ledger.budget)} MiB", highlight=False, soft_wrap=True)

    def cut(e):                             # kept in plan order; a fresh process with the kept keys says no
        console.print(f"cut by the fresh-process measurement: {e.id} ({e.error}); measuring the rest again",
                      highlight=False, markup=False, soft_wrap=True)

    res = merge_dirs(out, shards, measured, cut)
    m = res.manifest
    n = sum(e.status == Status.BUILT for e in m.entries)
    console.print(f"{n} built entries from {len(shards)} shards -> {out / 'manifest.json'}", highlight=False,
                  soft_wrap=True)
    console.print(f"{len(res.over_budget)} keys over the budget of the whole by the shards' measurements",
                  highlight=False, soft_wrap=True)
    if res.measure_error:
        err.print(f"error: the merged directory could not be measured: {res.measure_error}", highlight=False,
                  markup=False, soft_wrap=True)
        raise typer.Exit(1)
    if isinstance(m.measured, Measurement):
        took = "" if m.measured.load_seconds is None else f", {m.measured.load_seconds:.0f} s to load and run them"
        console.print(f"measured together in a fresh process ({m.measured.kind}): {mib(m.measured.total_bytes)} "
                      f"MiB of {mib(m.budget_bytes)} MiB{took}; {len(res.measured_over)} more keys over the budget "
                      f"by the merge's measurement ({len(res.fresh_cut)} of them cut by a fresh process)",
                      highlight=False, soft_wrap=True)
    elif res.measured_over and n == 0:
        console.print("nothing kept: no built key fits the budget by measurement", highlight=False)
    else:
        console.print(f"not measured together: {res.not_measured or 'every key was measured by its shard'}; c2w verify "
                      "measures the merged directory", highlight=False, soft_wrap=True)


def _traffic_profile(out: Path, profile: Optional[str]):
    """The profile whose traffic mix `c2w bench --traffic` runs: --profile, else the manifest's."""
    from c2w.exporter.profile import load_profile
    from c2w.runtime.manifest import read_manifest
    p = _load(profile, None, None) if profile else load_profile(read_manifest(out).profile.source)
    if p.traffic is None:
        raise C2WUserError("--traffic", f"profile {p.source} without a traffic section",
                           "a profile with a traffic section (docs/profiles.md)", "Name one with --profile.")
    return p


@app.command()
@user_errors
def bench(out: Optional[Path] = typer.Argument(None, help="artifact directory (default: artifacts/<profile name>)"),
          profile: Optional[str] = typer.Option(None, "--profile", "-p", help="profile whose artifacts to bench"),
          json_out: Optional[Path] = typer.Option(None, "--out", help="JSON results, a .md table beside it "
                                                  "(default: bench.json in the artifact directory)"),
          keys: Optional[str] = typer.Option(None, help="comma-separated key ids (default: every built key)"),
          batches: Optional[str] = typer.Option(None, help="batch sizes for the streaming rows (default: the profile's)"),
          reps: int = typer.Option(20, help="timed repetitions per measurement (after warm-up)"),
          warmup: Optional[int] = typer.Option(None, help="untimed calls before each measurement "
                                               "(default: 3 per key, 2 per streaming chunk)"),
          stream_reps: Optional[int] = typer.Option(None, help="timed repetitions per streaming chunk "
                                                    "(default: max(5, reps / 2))"),
          peer: bool = typer.Option(True, help="time the step-audio2 reference too, if importable"),
          serve: bool = typer.Option(False, "--serve", help="concurrent streams through the stream server instead"),
          concurrency: str = typer.Option("1,2,4,8,16,32,64", help="--serve: numbers of concurrent streams"),
          chunk_tokens: int = typer.Option(28, help="--serve: tokens per steady chunk (28 or 78)"),
          steady_chunks: int = typer.Option(8, help="--serve: steady chunks per stream"),
          stagger_ms: float = typer.Option(20.0, help="--serve: mean gap between stream arrivals"),
          arrival: str = typer.Option("fixed", help="--serve: fixed | poisson"),
          max_wait_ms: float = typer.Option(2.0, help="--serve: longest wait of a partial batch"),
          voices: int = typer.Option(0, help="--serve: streams share this many prompts (0: one per stream)"),
          lanes: int = typer.Option(1, help="--serve: batches the server may run at the same time"),
          token_rate: float = typer.Option(0.0, help="--serve: tokens per second each client's LLM yields after "
                                           "the first chunk (25 = real time; 0: closed loop, as fast as served)"),
          clients: str = typer.Option("threads", help="--serve: threads (a thread per client) | asyncio (every "
                                      "client a coroutine of one event loop)"),
          ahead: int = typer.Option(0, help="--serve: chunks each client keeps submitted beyond the one whose audio "
                                    "it waits for (0: submit once the last one is back; 1: the LLM's tokens are "
                                    "there before the audio)"),
          calibration: Optional[Path] = typer.Option(None, help="per-key eager and engine ms for the planner's "
                                                     "traffic section (default: calibration.json beside --out)"),
          traffic: bool = typer.Option(False, "--traffic", help="one session of each kind in the profile's traffic "
                                       "mix: measured engine hit rate vs the planner's prediction (the --profile's "
                                       "mix, else that of the profile the manifest names)"),
          cuda_graphs: Optional[bool] = typer.Option(None, "--cuda-graphs/--no-cuda-graphs", help="serve with engines "
                                                     "captured in CUDA graphs or not, as runtime.load(cuda_graphs=) "
                                                     "(default: the backend's; C2W_AOTI_CUDA_GRAPHS overrides it); "
                                                     "each key is timed both ways where its backend captures it")):
    """Latency of eager vs engine vs engine under CUDA-graph replay, per key and per streaming chunk;
    with --serve, concurrent streams through the stream server."""
    from c2w.exporter.bench.engines import bench_dir, to_markdown, write, write_calibration
    _quiet(False)
    if out is None:
        if profile is None:
            raise C2WUserError("c2w bench", "no artifact directory and no --profile",
                               "an artifact directory or --profile NAME", "e.g. c2w bench --profile cpu")
        out = Path("artifacts") / _load(profile, None, None).name
    json_out = json_out or out / ("serve.json" if serve else "bench.json")
    if serve:
        from c2w.exporter.bench import serving
        if arrival not in ("fixed", "poisson"):
            raise C2WUserError("--arrival", repr(arrival), "fixed or poisson")
        levels = _int_list("--concurrency", concurrency)
        if voices < 0:
            raise C2WUserError("--voices", voices, "0 (a prompt per stream) or a number of shared prompts")
        if lanes < 1:
            raise C2WUserError("--lanes", lanes, "1 or more")
        if token_rate < 0:
            raise C2WUserError("--token-rate", token_rate, "0 (closed loop) or a positive rate in tokens per second")
        if clients not in serving.CLIENTS:
            raise C2WUserError("--clients", repr(clients), " or ".join(serving.CLIENTS))
        if ahead < 0:
            raise C2WUserError("--ahead", ahead, "0 (closed loop) or the number of chunks a client keeps queued")
        res = serving.bench_serving(out, concurrency=levels, chunk_tokens=chunk_tokens,
                                    steady_chunks=steady_chunks, stagger_ms=stagger_ms, arrival=arrival,
                                    max_wait_ms=max_wait_ms, voices=voices, lanes=lanes, token_rate=token_rate,
                                    reps=reps, save=lambda r: write(r, json_out, serving.to_markdown),
                                    cuda_graphs=cuda_graphs, clients=clients, ahead=ahead)
        write(res, json_out, serving.to_markdown)
        typer.echo(serving.to_markdown(res))
        return
    warm = {} if warmup is None else {"warmup": warmup, "stream_warmup": warmup}
    res = bench_dir(out, reps=reps, keys=keys.split(",") if keys else None,
                    stream_batches=[int(b) for b in batches.split(",")] if batches else None, peer=peer,
                    out=json_out, stream_reps=stream_reps, traffic=_traffic_profile(out, profile) if traffic else None,
                    cuda_graphs=cuda_graphs, **warm)
    write(res, json_out)
    typer.echo(to_markdown(res))
    calibration = calibration or json_out.with_name("calibration.json")
    n = write_calibration(res, calibration)
    typer.echo(f"calibration: {n} keys -> {calibration}" if n else "calibration: no key was timed; none written")


if __name__ == "__main__":
    sys.exit(app())
