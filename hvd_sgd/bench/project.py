"""The projection (``--suites network,project``): what 8, 64 and 512 ranks would give, from the
network suite's measurements across two nodes in the same run.

Two models, fitted to those measurements:
- all-reduce, Horovod's ring: seconds(S, N) = k·2(N-1)·α + 2(N-1)/N · S/β for S bytes on N ranks
  in k operations (the latency is paid per operation, the bytes once). On 2 nodes one operation
  takes 2α + S/β: a least-squares line through hvd.allreduce's times per size gives α (half its
  intercept, Horovod's own per-operation cost included) and β (its slope's inverse). k is what
  Horovod's timeline counted in hvd_sgd's steps on the same link;
- compute: a rank's step with no all-reduce, from the two independent processes' throughput;
  and, for two GPU classes: from the model's multiply-adds at the rate Horovod's own ResNet-101
  benchmark implies for its GPUs, and as measured on an H200 (the same layers in PyTorch).
A step is compute + the all-reduce of the model's gradients, and efficiency = compute / step. No
overlap: on the virtual cluster's shared cores none shows; the validation also gives the bound
with overlap (``overlapped_allreduce``), which hosts with cores to spare could approach.
"""
import math

from hvd_sgd.bench import contenders
from hvd_sgd.bench.network import model_rows
from hvd_sgd.training.plan import global_batch, per_rank_batch

RANKS = (2, 8, 64, 512)
# Interconnects given by rate and per-message latency (typical figures, not measured here).
INTERCONNECTS = {"1 Gbit/s TCP": (1e9, 50e-6), "10 Gbit/s TCP": (10e9, 25e-6), "25 Gbit/s RoCE": (25e9, 5e-6),
                 "100 Gbit/s InfiniBand": (100e9, 1.5e-6)}
# Horovod's published benchmark: ResNet-101 at batch 64 per Pascal GPU, 16 GPUs at 1656.82 img/s
# (its docs/benchmarks), 90 % efficiency at 512 GPUs over 25 Gbit/s RoCE; 170 MB of gradients.
ANCHOR = dict(model="ResNet-101 (Horovod's benchmark)", gradient_bytes=170e6, step_seconds=64 / (1656.82 / 16),
              interconnect="25 Gbit/s RoCE", ranks=512, published_efficiency=0.90)
# The GPU class: the anchor's GPUs at the rate its step implies. ResNet-101 takes 7.6 G multiply-adds
# an image forward (He et al. 2016, table 1); training is about 3 times the forward pass, 2 FLOP each.
TRAINING_FLOP_PER_MULTIPLY_ADD = 6
GPU = dict(name="Pascal-class GPU (P100)", step_floor=1e-3,
           flop_per_second=TRAINING_FLOP_PER_MULTIPLY_ADD * 7.6e9 * 64 / ANCHOR["step_seconds"])
# A step of each model at the bench's per-rank batch on one H200, measured (docs/scaling.md, "The projection"): the
# same layers in PyTorch, fp32, launched op by op from Python. That machine had no TensorFlow that
# Horovod 0.28.1 builds against, so hvd_sgd itself did not run on it.
H200 = dict(name="H200 (measured, same layers in PyTorch)",
            step_seconds={"softmax": 0.77e-3, "cnn": 1.98e-3, "classic_cnn": 2.16e-3})
ASSUMPTIONS = [
    "ring all-reduce, one ring through all ranks, each rank sending 2(N-1)/N of the gradients",
    "no overlap of the backward pass with the all-reduce: the validation's other bound (each layer's gradients "
    "reduced as soon as they exist) is what hosts with cores to spare for Horovod's thread could reach",
    "a step's gradients go in as many all-reduce operations as Horovod's timeline counted on the measured link "
    "(it fuses the gradients that are ready together, up to 128 MiB; at a 0 ms cycle the first go while the "
    "backward pass goes on); each operation pays the latency, the bytes are sent once",
    "the anchor: one all-reduce operation a step",
    "the links measured here carry one rank per node; the fitted latency includes Horovod's per-operation cost",
    "not modelled: stragglers, a congested or oversubscribed network, hierarchical all-reduce, "
    "per-rank batches too small to keep a device busy",
    f"{GPU['name']}: {GPU['flop_per_second'] / 1e12:.1f} TFLOP/s of training work (the rate the anchor's step "
    f"implies), and at least {GPU['step_floor'] * 1e3:.0f} ms a step (a Keras step launches tens of kernels, "
    "each dispatched from the host); not measured here",
    f"{H200['name']}: the step measured at the bench's per-rank batch, launched op by op; replayed as one "
    "CUDA graph it was 4 to 15 times shorter (docs/scaling.md)",
]


def fit_link(allreduce):
    """α and β from hvd.allreduce's bus bandwidth per size on 2 ranks (there, seconds = S / bandwidth):
    least squares of relative errors, so that 4 KiB counts as much as 64 MiB."""
    sizes = allreduce["sizes"]
    seconds = [size / (gb_per_s * 1e9) for size, gb_per_s in zip(sizes, allreduce["horovod"])]
    # Minimise sum(((a + b s) / t - 1)^2): the normal equations of a 2 x 2 system.
    xs = [(1 / t, s / t) for s, t in zip(sizes, seconds)]
    aa, ab, bb = (sum(x[0] * x[0] for x in xs), sum(x[0] * x[1] for x in xs), sum(x[1] * x[1] for x in xs))
    ya, yb = sum(x[0] for x in xs), sum(x[1] for x in xs)
    det = aa * bb - ab * ab
    intercept, slope = (ya * bb - yb * ab) / det, (aa * yb - ab * ya) / det
    return dict(latency=max(intercept, 0.0) / 2, bandwidth=1 / slope if slope > 0 else math.inf)


def allreduce_seconds(nbytes, ranks, latency, bandwidth, operations=1):
    return operations * 2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * nbytes / bandwidth


def model_sizes(names):
    """Each built-in model's weights (4 bytes each to all-reduce), multiply-adds an example forward
    (its dense and convolution layers), and those two per such layer, first to last, at MNIST's shape."""
    from hvd_sgd.training import models  # TensorFlow, in this process: only once the contenders are done
    sizes = {}
    for name in names:
        model = models.BUILT_IN[name]((28, 28, 1), 10)
        layers = []
        for layer in model.layers:
            kernel = getattr(layer, "kernel", None)
            if kernel is not None:  # a convolution applies its kernel at every output position
                positions = math.prod(layer.output.shape[1:-1])
                layers.append(dict(gradient_bytes=4 * layer.count_params(),
                                   multiply_adds=math.prod(kernel.shape) * positions))
        sizes[name] = dict(parameters=model.count_params(), layers=layers,
                           multiply_adds=sum(layer["multiply_adds"] for layer in layers))
    return sizes


def overlapped_allreduce(layers, compute, ranks, latency, bandwidth):
    """Seconds of all-reduce left once the backward pass ends, and operations, when each layer's
    gradients are reduced as soon as they exist, as Horovod does at hvd_sgd's 0 ms cycle.

    The backward pass runs the layers last to first, each taking twice its forward multiply-adds'
    share of the step (the first layer once: its input needs no gradient); whatever is ready when
    the previous operation ends goes in one fused operation."""
    forward = [layer["multiply_adds"] for layer in layers]
    backward = [forward[0], *(2 * m for m in forward[1:])]
    seconds_per_multiply_add = compute / (sum(forward) + sum(backward))
    ready, backward_end = [], 0.0  # (seconds into the backward pass, gradient bytes), in the order they come
    for layer, multiply_adds in zip(reversed(layers), reversed(backward)):
        backward_end += multiply_adds * seconds_per_multiply_add
        ready.append((backward_end, layer["gradient_bytes"]))
    clock, operations = 0.0, 0
    while ready:
        clock = max(clock, ready[0][0])
        fused = [nbytes for at, nbytes in ready if at <= clock]
        ready = ready[len(fused):]
        clock += allreduce_seconds(sum(fused), ranks, latency, bandwidth)
        operations += 1
    return max(0.0, clock - backward_end), operations


def run(network, sizes):
    """``network``: the network suite's rows, per link; ``sizes``: model_sizes() of its models."""
    links = {link: fit_link(row["allreduce"]["mpi"]) for link, row in network.items()}
    interconnects = {**{f"{link} (measured)": fit for link, fit in links.items()},
                     **{name: dict(latency=latency, bandwidth=rate / 8)
                        for name, (rate, latency) in INTERCONNECTS.items()}}
    validation, projection = [], []
    for link, row in network.items():
        for model, measured in model_rows(row).items():
            gradient_bytes, operations = 4 * sizes[model]["parameters"], row["ops_per_step"][model]
            batch = per_rank_batch(contenders.GLOBAL_BATCH[model], 2)  # a rank's: 2 ranks, or 2 processes, of the global batch
            compute = batch / (measured["independent_2x1"] / 2)  # seconds a rank's step computes
            reduce = allreduce_seconds(gradient_bytes, 2, **links[link], operations=operations)
            exposed, simulated_operations = overlapped_allreduce(sizes[model]["layers"], compute, 2, **links[link])
            validation.append(dict(link=link, model=model, ops_per_step=operations,
                                   predicted=compute / (compute + reduce), measured=measured["ratio"],
                                   overlapped=compute / (compute + exposed), overlapped_ops=simulated_operations))
            if link != next(iter(network)):
                continue  # the compute is this machine's on every link: project from the first
            on_gpu = max(GPU["step_floor"], TRAINING_FLOP_PER_MULTIPLY_ADD * sizes[model]["multiply_adds"] * batch
                         / GPU["flop_per_second"])
            devices = [("this CPU (measured)", compute, interconnects), (GPU["name"], on_gpu, INTERCONNECTS)]
            if model in H200["step_seconds"]:
                devices.append((H200["name"], H200["step_seconds"][model], INTERCONNECTS))
            for device, step_compute, names in devices:
                for name in names:
                    for ranks in RANKS:
                        step = step_compute + allreduce_seconds(gradient_bytes, ranks, **interconnects[name],
                                                                operations=operations)
                        projection.append(dict(model=model, compute=device, interconnect=name, ranks=ranks,
                                               step_compute=step_compute, efficiency=step_compute / step,
                                               epoch_seconds=contenders.EXAMPLES_PER_EPOCH / global_batch(batch, ranks) * step))
    for v in validation:
        v["error"] = v["predicted"] / v["measured"] - 1
        v["overlapped_error"] = v["overlapped"] / v["measured"] - 1
    rate, latency = INTERCONNECTS[ANCHOR["interconnect"]]
    reduce = allreduce_seconds(ANCHOR["gradient_bytes"], ANCHOR["ranks"], latency, rate / 8)
    anchor = dict(ANCHOR, predicted_efficiency=ANCHOR["step_seconds"] / (ANCHOR["step_seconds"] + reduce))
    return dict(links=links, validation=validation, projection=projection, anchor=anchor, assumptions=ASSUMPTIONS)
