"""``python -m hvd_sgd.bench``: run the suites and write the report, or (``worker …``) be one contender."""
import argparse
import os
import re
import sys
import time

from hvd_sgd.bench import __doc__, network, protocol, record, report, suites

PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if protocol.is_worker(argv):
        from hvd_sgd.bench import workers  # TensorFlow: only in the contender processes
        kind, args = protocol.parse_worker_args(argv)
        return workers.WORKERS[kind](*args)
    parser = argparse.ArgumentParser(prog="python -m hvd_sgd.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="every suite small enough to finish in under 3 minutes")
    parser.add_argument("--results-dir", default="results/bench",
                        help="where results.json, results.md and the PNG plots go")
    parser.add_argument("--suites", default=",".join(suites.DEFAULT_SUITES),
                        help=f"comma-separated, from {','.join(suites.SUITES)} (lever: scaling and all-reduce without "
                             f"and with --lever; stacks: overhead and scaling on "
                             f"both stacks, the keras2 one set up too; network: as root, on a virtual cluster of "
                             f"2 nodes that it starts and stops)")
    parser.add_argument("--links", default=",".join(network.LINKS),
                        help=f"the network suite's links, from {','.join(network.LINKS)}")
    parser.add_argument("--models",
                        help=f"comma-separated, from {','.join(suites.MODELS)}: the models the overhead, scaling, "
                             f"peer, lever, stacks and network suites measure (default: all; with --quick the "
                             f"first two)")
    parser.add_argument("--lever", default=suites.DEFAULT_LEVER, metavar="NAME=VALUE",
                        help="the environment variable the lever suite sets in the rounds it runs with it "
                             "(Horovod's HOROVOD_*, Open MPI's OMPI_MCA_*, ...)")
    parser.add_argument("--data-dir",
                        help="the layout suite's data (hvd_sgd.train --data-dir); its --models may also name your "
                             "own, package.module:function")
    parser.add_argument("--record", action="store_true",
                        help="also keep the run as a dated record in --records-dir, with lscpu, and refresh the "
                             "README's results table beside it (when the run has the tta, scaling and peer suites)")
    parser.add_argument("--records-dir", default=os.path.join(PROJECT, "benchmarks"),
                        help="where --record writes; the README it refreshes is the one in its parent directory")
    parser.add_argument("--rounds", type=int,
                        help="times each pair of contenders runs, alternating (default 3; 1 with --quick)")
    args = parser.parse_args(argv)
    chosen = tuple(args.suites.split(","))
    if not set(chosen) <= set(suites.SUITES):
        parser.error(f"--suites: unknown {sorted(set(chosen) - set(suites.SUITES))}")
    if "project" in chosen and ("network" not in chosen or chosen.index("network") > chosen.index("project")):
        parser.error("--suites: project needs network before it (it projects from network's measurements)")
    if "stacks" in chosen and not os.path.exists(suites.stack_python("keras2")):
        parser.error(f"--suites stacks: no keras2 stack at {suites.stack_python('keras2')}: "
                     f"set it up with HVD_SGD_STACK=keras2 run/setup (run/bench does)")
    links = tuple(args.links.split(","))
    if not set(links) <= set(network.LINKS):
        parser.error(f"--links: unknown {sorted(set(links) - set(network.LINKS))}")
    models = tuple(args.models.split(",")) if args.models else suites.default_models(args.quick)
    unknown = {m for m in models if m not in suites.MODELS and not (chosen == ("layout",) and ":" in m)}
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)} (a package.module:function with --suites layout alone)")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", args.lever):
        parser.error(f"--lever: NAME=VALUE, an environment variable and its value, got {args.lever!r}")
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else 3
    if rounds < 1:
        parser.error(f"--rounds must be at least 1, got {rounds}")
    plan = suites.Plan(args.quick, args.results_dir, chosen, rounds, models, links, args.lever, args.data_dir)
    started = time.perf_counter()
    results = suites.run(plan)
    results["seconds"] = time.perf_counter() - started
    results["command"] = "python -m hvd_sgd.bench " + " ".join(argv)
    print(report.write(results, plan.results_dir))
    print(f"\n({results['seconds']:.0f} s; results in {plan.results_dir})")
    if args.record:
        kept = record.write(results, plan.results_dir, args.records_dir)
        print(f"record: {kept}")
        readme = os.path.join(os.path.dirname(os.path.abspath(args.records_dir)), "README.md")
        if all(suite in results["suites"] for suite in record.TABLE_SUITES) and os.path.exists(readme):
            if record.update_readme(readme, record.results_table(results, kept)):
                print(f"results table refreshed in {readme}")


def console_script():
    main()


if __name__ == "__main__":
    console_script()
