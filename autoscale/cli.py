"""`fleet simulate` (policy comparison on the simulated fleet) and `fleet autoscale run` (the live controller).

`register(subparsers)` adds both to the lead's argparse `fleet` CLI; `python -m autoscale.cli ...` runs
them standalone. Handlers are set as `func` (and `handler`) defaults and take the parsed args.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import time
from pathlib import Path

from common.settings import REPO_ROOT

log = logging.getLogger("autoscale")


def register(subparsers) -> None:
    """Add `simulate` and `autoscale run` to the `fleet` CLI."""
    from autoscale.simulator.settings import OURS_ARCHITECTURES, POLICIES

    sim = subparsers.add_parser("simulate", help="compare autoscaling policies on the simulated GPU fleet",
                                description="Fluid simulation of the two-region GPU fleet over a day on the requirements' "
                                            "numbers; compares static, reactive-gpu-util, reactive-signals, ours (forecast + "
                                            "warm buffer + tier-aware batch; colocated or split prefill/decode "
                                            "per pool) and disaggregated (ours' scaling, every pool split). "
                                            "Writes JSON + PNGs.")
    sim.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated subset of {','.join(POLICIES)}")
    sim.add_argument("--hours", type=float, default=24.0, help="measured horizon in hours (default 24)")
    sim.add_argument("--warmup-hours", type=float, default=15.0, help="simulated before the measured window (default 15)")
    sim.add_argument("--step-s", type=float, default=10.0, help="simulation step in seconds (default 10)")
    sim.add_argument("--seed", type=int, default=7)
    sim.add_argument("--assumptions", type=Path, default=None, help="assumptions JSON (default autoscale/simulator/assumptions.json)")
    sim.add_argument("--no-batch", action="store_true", help="simulate without batch-tier work")
    sim.add_argument("--calibrate", type=Path, default=None, metavar="FILE",
                     help="measured step costs (the engine bench's JSON, CPU or GPU, or JSON lines with batch/"
                          "prefill_tok_s/decode_step_ms) replacing one model's assumed throughput")
    sim.add_argument("--calibrate-model", default=None,
                     help="model the calibration applies to (default: the one whose replica has as many GPUs "
                          "as the measurement)")
    sim.add_argument("--reuse", type=float, default=None,
                     help="fix the interactive/standard prefix reuse (0..0.95) instead of the workload model's")
    sim.add_argument("--reuse-sweep", type=float, nargs="*", default=None, metavar="LEVEL",
                     help="also run ours with every pool colocated (the reference for its per-pool choice), then "
                          "rerun ours, ours-colocated and disaggregated at these reuse levels (default 0 .2 .4 "
                          ".5 .6 .8); writes <out>-reuse-sweep.json and docs/img/autoscale-{reuse-sweep,"
                          "disaggregated}.png")
    sim.add_argument("--ours-architecture", choices=OURS_ARCHITECTURES, default="auto",
                     help="how ours serves each (region, model) pool: auto (default) = per pool, colocated or "
                          "split prefill/decode pools, whichever the capacity model plans to need fewer "
                          "replica-seconds per request while holding the TTFT SLO and the stream speed "
                          "(the choice is in the JSON's ours_architecture_choice); colocated / disaggregated "
                          "force one for every pool")
    sim.add_argument("--no-failure", action="store_true", help="no node failure at the peak")
    sim.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "autoscale-simulation.json",
                     help="JSON results path")
    sim.add_argument("--img-dir", type=Path, default=REPO_ROOT / "docs" / "img", help="directory for PNG plots")
    sim.add_argument("--no-plots", action="store_true")
    sim.add_argument("--no-progress", action="store_true")
    sim.set_defaults(func=cmd_simulate, handler=cmd_simulate)

    auto = subparsers.add_parser("autoscale", help="the live autoscaler")
    auto_sub = auto.add_subparsers(dest="autoscale_command", required=True)
    run = auto_sub.add_parser("run", help="run the controller loop against the router and an actuator",
                              description="Scales every managed model version: each warm_buffers row and each "
                                          "routed version (a routed version without a row inherits its model's "
                                          "settings). The set is re-read every tick.")
    run.add_argument("--actuator", choices=("local", "kubernetes"), default="local")
    run.add_argument("--interval-s", type=float, default=2.0)
    run.add_argument("--duration-s", type=float, default=None, help="stop after this long (default: until Ctrl-C)")
    run.add_argument("--router-url", default=None, help="router admin URL (default from settings)")
    run.add_argument("--model", default=None, help="only this model's pools")
    run.add_argument("--max-running-per-replica", type=int, default=8)
    run.add_argument("--target-load", type=float, default=0.7)
    run.add_argument("--namespace", default="llm", help="Kubernetes namespace")
    run.add_argument("--image", default=None, help="replica image for the Kubernetes actuator's Deployments "
                                                   "(default: the GPU image tag deploy/overlays/gpu-prod uses)")
    run.add_argument("--once", action="store_true", help="one tick, print the decisions as JSON, exit")
    run.add_argument("--history-weeks", type=int, default=3,
                     help="weeks of usage-store history the forecaster is fitted on (0 = no forecast)")
    run.add_argument("--cpu-cores", type=int, default=None,
                     help="local actuator: cores the replicas may use (default: this machine's); replicas x "
                          "engine threads stays within them")
    run.add_argument("--no-cpu-budget", action="store_true",
                     help="local actuator: start replicas beyond cores / engine threads (they share cores)")
    run.set_defaults(func=cmd_autoscale_run, handler=cmd_autoscale_run)


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from autoscale.simulator.engine import prepare, run_simulation
    from autoscale.simulator.report import plot_pngs, results_json, summary_table, write_json
    from autoscale.simulator.settings import POLICIES, TIER_AWARE, SimSettings

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {list(POLICIES)}")
    if args.reuse is not None and not 0.0 <= args.reuse <= 0.95:
        raise SystemExit(f"--reuse {args.reuse}: must be between 0 and 0.95 (share of prompt tokens from cache)")
    settings = SimSettings.from_file(args.assumptions, horizon_h=args.hours, warmup_h=args.warmup_hours,
                                     step_s=args.step_s, seed=args.seed, batch_enabled=not args.no_batch,
                                     node_failure=not args.no_failure, reuse_override=args.reuse,
                                     ours_architecture=args.ours_architecture)
    if args.calibrate is not None:
        from autoscale.simulator.calibrate import calibrated_assumptions

        try:
            settings.assumptions = calibrated_assumptions(settings.assumptions, args.calibrate, args.calibrate_model,
                                                          settings.serving.stream_tokens_per_s)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--calibrate: {exc}") from exc
    console = Console()
    t0, cpu0 = time.monotonic(), time.process_time()
    log.info("preparing workload (%.0f M requests/day, %d pools) and forecasts", settings.workload.requests_per_day / 1e6,
             len(settings.pools()))
    inputs = prepare(settings, with_forecast=any(p in TIER_AWARE for p in policies))
    results = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=console, disable=args.no_progress) as progress:
        for name in policies:
            task = progress.add_task(f"simulating {name}", total=len(inputs.t_s))
            results[name] = run_simulation(name, settings, inputs, lambda adv, _t=task: progress.advance(_t, adv))
            progress.update(task, completed=len(inputs.t_s))
    wall = time.monotonic() - t0
    payload = results_json(results, settings, wall, inputs)
    payload["run"]["cpu_s"] = time.process_time() - cpu0  # the machine is shared: CPU time is the comparable figure
    write_json(payload, args.out)
    if not args.no_plots:
        plot_pngs(results, args.img_dir)
    if args.reuse_sweep is not None:
        from autoscale.simulator.sweep import DEFAULT_LEVELS, sweep_and_compare

        sweep_and_compare(settings, inputs, results, tuple(args.reuse_sweep) or DEFAULT_LEVELS,
                          args.out.with_name(args.out.stem + "-reuse-sweep.json"),
                          None if args.no_plots else args.img_dir)
    table = Table(title=f"{args.hours:.0f} h simulated in {wall:.1f} s, {payload['run']['cpu_s']:.1f} s of CPU "
                        f"(seed {args.seed})")
    rows = summary_table(results)
    for col in rows[0]:
        table.add_column(col)
    for row in rows:
        table.add_row(*[str(v) for v in row.values()])
    console.print(table)
    sizing = payload["peak_sizing"]
    per_model = ", ".join(f"{m['model']}: {m['gpus']}" for m in sizing["models"])
    console.print(f"requirements' peak estimate from the assumptions: {sizing['total_gpus']} GPUs ({per_model})")
    return 0


def cmd_autoscale_run(args: argparse.Namespace) -> int:
    from autoscale.controller import Controller, pools_from_registry
    from common.settings import load_settings

    settings = load_settings()

    def managed() -> list:  # re-read every tick: a rollout's new version is managed at once
        pools = [p for p in pools_from_registry(settings.db_url, settings.region) if args.model in (None, p.spec.model)]
        for pool in pools:
            pool.max_running_per_replica, pool.target_load = args.max_running_per_replica, args.target_load
        return pools
    pools = managed()
    if not pools:
        log.info("no routed model version and no warm_buffers row yet: waiting for one")
    if args.actuator == "local":
        from autoscale.actuators.local import LocalActuator

        token = settings.admin_token_file.read_text().strip() if settings.admin_token_file.exists() else None
        actuator = LocalActuator(settings, [args.router_url or settings.router_http_url], admin_token=token,
                                 cpu_cores=args.cpu_cores, cpu_budget=not args.no_cpu_budget)
        log.info("local actuator: at most %s replicas (%d cores)", actuator.max_replicas or "unbounded",
                 actuator.cpu_cores)
    else:
        from autoscale.actuators.kubernetes import KubernetesActuator

        actuator = KubernetesActuator(args.namespace, image=args.image, db_url=settings.db_url)
    token = settings.operator_token()  # FLEET_ADMIN_TOKEN (a Secret in Kubernetes), else the data dir's file
    from autoscale.live_inputs import forecasts_from_usage

    if args.history_weeks and not settings.usage_db_path.exists():  # say so: scaling ahead of load is off
        log.warning("forecasting is off: no usage store at %s (in Kubernetes it is the loader's volume); scaling on "
                    "live signals only", settings.usage_db_path)
    forecasts = forecasts_from_usage(settings.usage_db_path, pools, args.history_weeks) if args.history_weeks else {}
    controller = Controller(pools, actuator, args.router_url or settings.router_http_url, args.interval_s, admin_token=token,
                            forecasts=forecasts, pools_source=managed,
                            decisions_path=settings.data_dir / "autoscale" / "decisions.jsonl")
    if args.once:
        print(json.dumps([d.__dict__ for d in controller.tick()], indent=2))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: controller.stop())
    try:
        controller.run(args.duration_s)
    except KeyboardInterrupt:
        controller.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    from common.logs import setup_logging
    from common.settings import load_settings

    settings = load_settings()
    setup_logging("autoscale", settings.log_level, settings.log_format)
    parser = argparse.ArgumentParser(prog="python -m autoscale.cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
