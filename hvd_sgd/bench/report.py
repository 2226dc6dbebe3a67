"""The report: PASS/MISS per target, results.json, results.md and PNG plots."""
import json
import os
import statistics

from hvd_sgd.bench import network
from hvd_sgd.bench.suites import contender_names

TARGETS = [  # (name, suite or suite/part, model, measured ratio key, minimum)
    ("classic CNN 2 ranks >= 1.15 x MWMS", "peer", "classic_cnn", "ratio", 1.15),
    ("classic CNN scaling efficiency >= 0.90", "scaling", "classic_cnn", "ratio", 0.90),
    ("1-rank overhead <= 3 % (classic CNN)", "overhead", "classic_cnn", "ratio", 0.97),
    ("1-rank overhead <= 3 % (softmax)", "overhead", "softmax", "ratio", 0.97),
    ("softmax 2 ranks >= 3 x MWMS", "peer", "softmax", "ratio", 3.0),
    ("streamed classic CNN 64x64x3, folder >= 0.9 x memory", "input/sets", "classic_cnn 64x64x3",
     "folder_over_memory", 0.9),
    ("streamed classic CNN 64x64x3, TFRecord >= 0.9 x memory", "input/sets", "classic_cnn 64x64x3",
     "tfrecord_over_memory", 0.9),
]
ALLREDUCE_TARGET = ("all-reduce >= 0.8 x raw MPI from 1 MiB up", 0.8, 1 << 20)


def verdicts(results):
    """PASS/MISS for every target whose suite ran: a miss is reported, never hidden."""
    lines = []
    for name, path, model, key, minimum in TARGETS:
        rows = results["suites"]
        for part in path.split("/"):  # a suite, or a suite's part
            rows = rows.get(part, {})
        row = rows.get(model)
        if row:
            lines.append((name, row[key], minimum, row[key] >= minimum))
    if "allreduce" in results["suites"]:
        name, minimum, from_bytes = ALLREDUCE_TARGET
        mpi = results["suites"]["allreduce"]["mpi"]
        worst = min(statistics.median(ratios) for size, ratios in zip(mpi["sizes"], mpi["ratios"])
                    if size >= from_bytes)
        lines.append((name, worst, minimum, worst >= minimum))
    return lines


def write(results, directory):
    os.makedirs(directory, exist_ok=True)
    results["verdicts"] = [dict(target=name, measured=round(value, 3), minimum=minimum, passed=passed)
                           for name, value, minimum, passed in verdicts(results)]
    with open(os.path.join(directory, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    md = [f"# hvd_sgd benchmark: {', '.join(results['suites'])}{' (quick)' if results['quick'] else ''}", "",
          f"Machine: {results['machine']['cores']} cores, {results['machine']['platform']}. "
          f"Images per second are medians over {results['rounds']} round(s); "
          f"a ratio is the median of per-round ratios.", ""]
    for suite, rows in results["suites"].items():
        md += [f"## {suite}", ""]
        if suite == "allreduce":
            md += _allreduce_table(rows)
        elif suite == "network":
            md += ["2 nodes of run/cluster, 1 rank each. Efficiency: hvd_sgd on the 2 nodes over 2 independent "
                   "processes (no all-reduce) on the same cores.", "",
                   "| link | model | hvd_sgd 2 nodes img/s | 2 independent img/s | efficiency | per-round | "
                   "all-reduces a step |", "| --- | --- | --- | --- | --- | --- | --- |"]
            for link, row in rows.items():
                for model, r in network.model_rows(row).items():
                    ours, theirs = contender_names(r)
                    md.append(f"| {link} | {model} | {r[ours]:.0f} | {r[theirs]:.0f} | {r['ratio']:.2f} | "
                              f"{', '.join(f'{x:.2f}' for x in r['rounds']['ratio'])} | "
                              f"{row['ops_per_step'][model]:.2f} |")
            for link, row in rows.items():
                md += ["", f"All-reduce across the nodes, link {link}:", "", *_allreduce_table(row["allreduce"])]
                if row.get("decomposition"):
                    md += ["", f"Link {link}, where the step of 2 nodes goes:", "",
                           *_decomposition_table(row["decomposition"])]
        elif suite == "tta":
            md += _tta_tables(rows)
        elif suite == "project":
            md += _project_tables(rows)
        elif suite == "stacks":
            md += _stacks_table(rows)
        elif suite == "lever":
            md += _lever_tables(rows)
        elif suite == "input":
            md += _input_table(rows)
        elif suite == "precision":
            md += _precision_tables(rows)
        elif suite == "layout":
            md += _layout_tables(rows)
        else:
            keys = contender_names(next(iter(rows.values())))
            md += [f"| model | {' img/s | '.join(keys)} img/s | ratio | per-round ratios |",
                   "| --- |" + " --- |" * (len(keys) + 2)]
            md += [f"| {m} | {' | '.join(f'{r[k]:.0f}' for k in keys)} | {r['ratio']:.2f} | "
                   f"{', '.join(f'{x:.2f}' for x in r['rounds']['ratio'])} |" for m, r in rows.items()]
            if suite == "scaling" and all("decomposition" in r for r in rows.values()):
                md += ["", *_decomposition_table({m: r["decomposition"] for m, r in rows.items()})]
        md.append("")
    md += ["## Targets", "", "| target | measured | needed | |", "| --- | --- | --- | --- |"]
    md += [f"| {v['target']} | {v['measured']} | {v['minimum']} | {'PASS' if v['passed'] else 'MISS'} |"
           for v in results["verdicts"]]
    with open(os.path.join(directory, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    _plot(results, directory)
    return "\n".join(md)


def _allreduce_table(rows):
    lines = ["Bus bandwidth, GB/s, each library's median over the rounds. Each all-reduce reduces the previous "
             "one's result; ratio: the median of the per-round ratios (range in brackets), each round's the "
             "median over its pairs of blocks timed next to each other. The last column "
             "reduces one send buffer over and over (the textbook loop, shown, not the target).", "",
             "| controller | size | hvd.allreduce | mpi4py Allreduce | ratio | per-round range | "
             "mpi4py, fixed buffers |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for controller, r in rows.items():
        for i, size in enumerate(r["sizes"]):
            versus = (f"{r['mpi4py'][i]:.3f} | {statistics.median(r['ratios'][i]):.2f} | "
                      f"{min(r['ratios'][i]):.2f}-{max(r['ratios'][i]):.2f} | {r['mpi4py_fixed_buffers'][i]:.3f}"
                      if r["mpi4py"] else "— | — | — | —")
            lines.append(f"| {controller} | {_size(size)} | {r['horovod'][i]:.3f} | {versus} |")
    return lines


def _tta_tables(rows):
    """Time to the target per contender, then where each one's seconds went."""
    target = next(iter(rows.values()))["target"]
    md = [f"Wall seconds from the command to the first test evaluation at >= {target} (the default recipe; "
          "hvd_sgd_np2 under mpirun, as run/train starts it; keras: the same recipe in plain Keras, one process "
          "on every core).", "",
          "| contender | to target, s | epochs | final accuracy | whole run, s |", "| --- | --- | --- | --- | --- |"]
    md += [f"| {name} | {r['to_target'] or float('nan'):.1f} | {r['epochs_to_target'] or '-'} | {r['accuracy']:.4f} | "
           f"{r['seconds']:.1f} |" for name, r in rows.items()]
    phases = list(next(iter(rows.values()))["startup"])
    md += ["", "Where the seconds went:", "", f"| contender | {' | '.join(phases)} |",
           "| --- |" + " --- |" * len(phases)]
    md += [f"| {name} | " + " | ".join(f"{r['startup'][p]:.1f}" for p in phases) + " |" for name, r in rows.items()]
    return md


def _project_tables(p):
    md = ["Fitted on 2 nodes: " + "; ".join(f"{link}: latency {f['latency'] * 1e6:.0f} µs, bandwidth "
                                            f"{f['bandwidth'] / 1e9:.3f} GB/s" for link, f in p["links"].items()),
          "", "Validation, 2 nodes x 1 rank (predicted efficiency against the network suite's measured one):", "",
          "| link | model | all-reduces a step (timeline) | predicted | measured | error "
          "| with overlap (operations) | its error |",
          "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    md += [f"| {v['link']} | {v['model']} | {v['ops_per_step']:.2f} | {v['predicted']:.2f} | {v['measured']:.2f} | "
           f"{v['error']:+.0%} | {v['overlapped']:.2f} ({v['overlapped_ops']}) | {v['overlapped_error']:+.0%} |"
           for v in p["validation"]]
    ranks = sorted({r["ranks"] for r in p["projection"]})
    md += ["", "Projected efficiency (seconds per epoch of 60 000 examples), with a rank's compute measured on this "
           "machine or given for a GPU class (its step in ms):", "",
           f"| model | compute | interconnect | {' | '.join(f'{n} ranks' for n in ranks)} |",
           "| --- | --- | --- |" + " --- |" * len(ranks)]
    rows = {}
    for r in p["projection"]:
        key = (r["model"], f"{r['compute']} ({r['step_compute'] * 1e3:.2g} ms)", r["interconnect"])
        rows.setdefault(key, []).append(f"{r['efficiency']:.2f} ({r['epoch_seconds']:.3g})")
    md += [f"| {' | '.join(key)} | {' | '.join(cells)} |" for key, cells in rows.items()]
    a = p["anchor"]
    difference = a["predicted_efficiency"] - a["published_efficiency"]
    md += ["", f"Anchor: {a['model']}, {a['gradient_bytes'] / 1e6:.0f} MB of gradients, a {a['step_seconds']:.2f} s "
           f"step, {a['interconnect']}, {a['ranks']} ranks: predicted {a['predicted_efficiency']:.2f}, published "
           f"{a['published_efficiency']:.2f} (difference {difference:+.2f}).",
           "", "Assumptions:", "", *[f"- {line}" for line in p["assumptions"]]]
    return md


def _stacks_table(rows):
    lines = ["The overhead and scaling suites on each stack (current: the newest TensorFlow, Keras 3; keras2: "
             "TensorFlow 2.15, Keras 2), and hvd_sgd's img/s on the current stack over the keras2 stack's.", "",
             "| model | stack | hvd_sgd 1 rank | plain Keras | overhead ratio | hvd_sgd 2 ranks | 2 independent | "
             "scaling | current / keras2 |", "| --- |" + " --- |" * 8]
    for model, row in rows.items():
        for stack in (s for s in row if s != "current_over_keras2"):
            overhead, scaling = row[stack]["overhead"], row[stack]["scaling"]
            versus = ", ".join(f"{k} {v:.2f}" for k, v in row["current_over_keras2"].items()) \
                if stack == "current" else ""
            lines.append(f"| {model} | {stack} | {overhead['hvd_sgd_np1']:.0f} | {overhead['keras_np1']:.0f} | "
                         f"{overhead['ratio']:.2f} | {scaling['hvd_sgd_np2']:.0f} | {scaling['independent_2x1']:.0f} | "
                         f"{scaling['ratio']:.2f} | {versus} |")
    return lines


def _lever_tables(lever):
    """Each figure without and with the lever: the median over the rounds (their range in brackets)."""
    def cell(values, digits=2):
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"
    md = [f"Without and with `{lever['variable']}={lever['value']}`, the two alternating round by round.", "",
          "| model | scaling without | scaling with |", "| --- | --- | --- |"]
    md += [f"| {model} | {cell(row['without'])} | {cell(row['with'])} |" for model, row in lever["scaling"].items()]
    r = lever["allreduce"]
    md += ["", "hvd.allreduce (MPI controller), bus bandwidth GB/s and its ratio to mpi4py's Allreduce:", "",
           "| size | GB/s without | GB/s with | with / without | hvd / mpi4py without | hvd / mpi4py with |",
           "| --- | --- | --- | --- | --- | --- |"]
    for i, size in enumerate(r["sizes"]):
        without, with_ = r["horovod"]["without"][i], r["horovod"]["with"][i]
        to_mpi4py = r["horovod_over_mpi4py"]
        md.append(f"| {_size(size)} | {cell(without, 3)} | {cell(with_, 3)} | "
                  f"{cell([w / wo for w, wo in zip(with_, without)])} | {cell(to_mpi4py['without'][i])} | "
                  f"{cell(to_mpi4py['with'][i])} |")
    return md


def _decomposition_table(rows):
    """Each model's step on 2 ranks and the ceiling's, in its parts, and what 2 ranks lose in each
    (``rows``: {model: decomposition.row})."""
    from hvd_sgd.bench.decomposition import PARTS
    md = ["Where the step goes (bench/decomposition.py; ms, means over steps, ranks and blocks): the same ranks "
          "in alternating blocks of the step with no all-reduce (the ceiling), of the same step with its "
          "gradients averaged (the bare step, timed in its parts), and of hvd_sgd's own `fit`. Each part: 2 "
          "ranks / the ceiling (what 2 ranks lose). *hvd_sgd*: what its own step adds to the bare one. "
          "Efficiency: the ceiling's step over hvd_sgd's (over the bare step's), the median of the blocks'. "
          "*Slower rank*: the part of the wait that one rank slower than the other through a whole block "
          "explains (the ceiling's ranks, each on its own).", "",
          f"| model | step: hvd_sgd / bare / ceiling | efficiency | {' | '.join(PARTS)} | hvd_sgd | slower rank |",
          "| --- | --- | --- |" + " --- |" * (len(PARTS) + 2)]
    for model, d in rows.items():
        cells = [f"{d['ranks'][p]:.3f} / {d['ceiling'][p]:.3f} ({d['lost'][p]:+.3f})" for p in PARTS]
        md.append(f"| {model} | {d['hvd_sgd_step']:.3f} / {d['ranks']['step']:.3f} / {d['ceiling']['step']:.3f} | "
                  f"{d['efficiency']:.2f} ({d['efficiency_bare']:.2f}) | " + " | ".join(cells)
                  + f" | {d['lost']['hvd_sgd']:+.3f} | {d['ceiling']['slower_rank']:.3f} |")
    return md


def _input_table(suite):
    """Throughput by source, 2 ranks, and the decode rate of one call and of every core; evaluation
    by rank 0 alone and by every rank; the default recipe from arrays and from a JPEG folder tree."""
    rows = suite["sets"]
    decodes = sorted({int(t) for row in rows.values() for t in row["decode_per_second"]})
    md = ["hvd_sgd on 2 ranks, the same model and images from memory (an .npz), JPEG image folders and JPEG "
          "TFRecord shards, alternating; img/s medians, ratios the median of the per-round ratios. Decode: "
          "images a second one process reads and decodes from the folders, on 1 call and on every core.", "",
          "| model and images | memory | folder | tfrecord | folder / memory | tfrecord / memory | "
          + " | ".join(f"decode, {t} call(s)" for t in decodes) + " |", "| --- |" + " --- |" * (5 + len(decodes))]
    md += [f"| {name} | {r['memory']:.0f} | {r['folder']:.0f} | {r['tfrecord']:.0f} | {r['folder_over_memory']:.2f} | "
           f"{r['tfrecord_over_memory']:.2f} | " + " | ".join(f"{r['decode_per_second'][str(t)]:.0f}" for t in decodes)
           + " |" for name, r in rows.items()]
    md += ["", "Evaluating the whole test set on 2 ranks: seconds, medians; rank 0 alone while the other "
           "waits, or both ranks on a half each with the sums all-reduced (hvd_sgd's way).", "",
           "| model and images | source | test images | rank 0 alone, s | both ranks, s | both / alone | "
           "correct, alone = both |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        for source, e in r["evaluation"].items():
            alone, together = statistics.median(e["alone"]), statistics.median(e["together"])
            md.append(f"| {name} | {source} | {e['correct_alone'][1]} | {alone:.3f} | {together:.3f} | "
                      f"{together / alone:.2f} | {'yes' if e['correct_alone'] == e['correct_together'] else 'NO'} |")
    recipe = suite["recipe"]
    md += ["", f"The default recipe on 2 ranks on {recipe['dataset']}: test accuracy and seconds from the command "
           "to its end, by seed, from the arrays and from the same images as a JPEG folder tree.", "",
           "| source | accuracy | seconds |", "| --- | --- | --- |"]
    md += [f"| {source} | {', '.join(format(r['accuracy'], '.4f') for r in runs)} | "
           f"{', '.join(format(r['seconds'], '.0f') for r in runs)} |" for source, runs in recipe["runs"].items()]
    return md


def _precision_tables(rows):
    md = [f"CPU features: {', '.join(rows['cpu'])}. Throughput, hvd_sgd's img/s, the precisions alternating; ratio: "
          "mixed_bfloat16 / float32, the median of the per-round ratios.", "",
          "| model | float32 | mixed_bfloat16 | ratio | per-round |", "| --- | --- | --- | --- | --- |"]
    md += [f"| {name} | {r['float32']:.0f} | {r['mixed_bfloat16']:.0f} | {r['ratio']:.2f} | "
           f"{', '.join(f'{b / f:.2f}' for b, f in zip(r['rounds']['mixed_bfloat16'], r['rounds']['float32']))} |"
           for name, r in rows["throughput"].items()]
    if "float16" in rows:
        f16 = rows["float16"]
        md += ["", f"mixed_float16 (forced), `cnn` on 2 ranks: {f16['mixed_float16']:.0f} img/s against float32's "
                   f"{f16['float32']:.0f}: float32 / mixed_float16 = **{f16['slowdown']:.1f}** (per round: "
                   f"{', '.join(f'{f / h:.1f}' for f, h in zip(f16['rounds']['float32'], f16['rounds']['mixed_float16']))})."]
    md += ["", "The default recipe on 2 ranks: test accuracy by seed, and seconds from the command to 0.99.", "",
           "| data and precision | accuracy | to 0.99, s |", "| --- | --- | --- |"]
    for name, runs in rows["recipe"].items():
        accuracies = ", ".join(f"{r['accuracy']:.4f}" for r in runs)
        times = ", ".join(f"{r['to_99']:.1f}" if r["to_99"] else "-" for r in runs)
        md.append(f"| {name} | {accuracies} | {times} |")
    return md


def _layout_tables(rows):
    """Each model's layouts: img/s, and its share of the fastest's; then the fastest's commands."""
    md = ["The same global batch in each layout of this machine (ranks x threads per rank), alternating round by "
          "round; img/s medians.", "", "| model | layout | img/s | of the fastest | per-round img/s |",
          "| --- | --- | --- | --- | --- |"]
    for model, row in rows.items():
        md += [f"| {model} | {r['ranks']} x {r['threads']} | {r['images_per_second']:.0f} | {r['of_fastest']:.2f} | "
               f"{', '.join(f'{x:.0f}' for x in r['rounds'])} |" for r in row["layouts"]]
    for model, row in rows.items():
        md += ["", f"{model}, fastest {row['fastest']['ranks']} x {row['fastest']['threads']}:", "", "```",
               *row["commands"], "```"]
    return md


def _size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _save(fig, directory, name):
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(os.path.join(directory, name))
    plt.close(fig)


def _plot(results, directory):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for suite in ("overhead", "scaling", "peer"):
        rows = results["suites"].get(suite)
        if not rows:
            continue
        fig, axes = plt.subplots(1, len(rows), figsize=(4.5 * len(rows), 3.5))
        for ax, (model, row) in zip(list(getattr(axes, "flat", [axes])), rows.items()):
            keys = contender_names(row)
            ax.bar(keys, [row[k] for k in keys], color=["tab:blue", "tab:gray"])
            ax.set_title(f"{suite}: {model} (ratio {row['ratio']:.2f})")
            ax.set_ylabel("images / second")
        _save(fig, directory, f"{suite}.png")
    if all("decomposition" in r for r in results["suites"].get("scaling", {1: {}}).values()):
        from hvd_sgd.bench.decomposition import PARTS
        rows = results["suites"]["scaling"]
        fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.5), squeeze=False)
        for ax, (model, r) in zip(axes[0], rows.items()):
            bottom = [0.0, 0.0]
            for part in (*PARTS, "hvd_sgd"):
                heights = [r["decomposition"]["ranks"][part], r["decomposition"]["ceiling"][part]]
                ax.bar(["2 ranks", "ceiling"], heights, bottom=bottom, label=part)
                bottom = [b + h for b, h in zip(bottom, heights)]
            ax.set_title(f"{model}: efficiency {r['decomposition']['efficiency']:.2f}")
            ax.set_ylabel("ms a step")
        axes[0][0].legend(fontsize="small")
        _save(fig, directory, "decomposition.png")
    if "scaling" in results["suites"]:
        rows = results["suites"]["scaling"]
        fig, ax = plt.subplots(figsize=(4.5, 3.5))
        ax.bar(list(rows), [r["ratio"] for r in rows.values()], color="tab:green")
        ax.axhline(0.9, color="red", linestyle="--", label="target 0.90")
        ax.set_ylabel("np2 / two independent processes")
        ax.set_title("scaling efficiency")
        ax.legend()
        _save(fig, directory, "scaling_efficiency.png")
    if "tta" in results["suites"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, r in results["suites"]["tta"].items():
            ax.plot(*zip(*r["curve"]), marker="o", label=name)
            target = r["target"]
        ax.axhline(target, color="red", linestyle="--", label=f"target {target}")
        ax.set_xlabel("wall seconds from the command")
        ax.set_ylabel("test accuracy")
        ax.set_title("time to accuracy, default recipe")
        ax.legend()
        _save(fig, directory, "tta.png")
    if "project" in results["suites"]:
        projection = results["suites"]["project"]["projection"]
        models = list(dict.fromkeys(r["model"] for r in projection))
        devices = list(dict.fromkeys(r["compute"] for r in projection))
        fig, axes = plt.subplots(len(devices), len(models), figsize=(5.5 * len(models), 4 * len(devices)),
                                 squeeze=False)
        for device, row in zip(devices, axes):
            for ax, model in zip(row, models):
                lines = {}
                for r in projection:
                    if (r["model"], r["compute"]) == (model, device):
                        lines.setdefault(r["interconnect"], []).append((r["ranks"], r["efficiency"]))
                for name, points in lines.items():
                    ax.plot(*zip(*points), marker="o", label=name)
                ax.set_xscale("log", base=2)
                ax.set_ylim(0, 1.05)
                ax.set_xlabel("ranks")
                ax.set_ylabel("projected scaling efficiency")
                ax.set_title(f"{model}: {device}")
                ax.legend(fontsize="small")
        _save(fig, directory, "project.png")
    allreduce = {"allreduce": results["suites"].get("allreduce")}
    allreduce.update({f"network_{link}": row["allreduce"]
                      for link, row in results["suites"].get("network", {}).items()})
    for name, rows in allreduce.items():
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for controller, r in rows.items():
            ax.plot(r["sizes"], r["horovod"], marker="o", label=f"hvd.allreduce ({controller} controller)")
            if r["mpi4py"]:
                ax.plot(r["sizes"], r["mpi4py"], marker="s", linestyle="--", label="mpi4py Allreduce (raw MPI)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes")
        ax.set_ylabel("bus bandwidth, GB/s")
        ax.set_title(f"all-reduce, 2 ranks{', across 2 nodes, link ' + name[8:] if name != 'allreduce' else ''}")
        ax.legend()
        _save(fig, directory, f"{name}.png")


